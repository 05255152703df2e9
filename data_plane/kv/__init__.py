"""Paged KV cache: block pools per tier, per-request block tables, the cache tensors."""
