"""The OpenAI-compatible gateway (not built yet; see the gateway issue)."""
