"""The engine loop: requests, scheduling (policy plans), model execution, sampling."""
