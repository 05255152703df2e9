"""The OpenAI-compatible gateway: REST and SSE, admission, routing to workers, admin API,
metrics (README's layout table names each module's job)."""
