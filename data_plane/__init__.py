"""The GPU worker: models, paged two-tier KV cache, engine loop and DuplexKV transfers."""
