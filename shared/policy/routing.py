"""Which worker gets a new request: pure functions over the numbers a worker reports."""

from __future__ import annotations

import hashlib


def kv_usage(num_blocks: int, num_free: int) -> float:
    """Fraction of a KV pool in use (0 for a pool with no blocks)."""
    return 0.0 if num_blocks <= 0 else 1.0 - num_free / num_blocks


def predicted_lag_s(
    iteration_time_s: float, num_queued_tokens: int, max_num_batched_tokens: int, hbm_usage: float
) -> float:
    """How long a new request would wait on a worker: the iterations it takes to drain the
    prompt tokens queued ahead of it, at its recent iteration time (an idle worker's: its
    measured step time, never 0, or it drew every request of a burst), weighted up by HBM
    pressure (a full HBM pool admits by rotation, which is slower than into free blocks)."""
    iterations = 1.0 + num_queued_tokens / max(1, max_num_batched_tokens)
    return max(iteration_time_s, 1e-3) * iterations * (1.0 + hbm_usage)


def worker_for_key(key: str, worker_ids: list[str]) -> str | None:
    """The worker a cache key (``prompt_cache_key``) goes to: rendezvous hashing, so every
    gateway picks the same one without sharing state, and a worker joining or leaving moves
    only the keys that pick it (None without workers)."""
    if not worker_ids:
        return None
    return max(worker_ids, key=lambda worker_id: _score(key, worker_id))


def _score(key: str, worker_id: str) -> bytes:
    return hashlib.blake2b(f"{worker_id}\x00{key}".encode(), digest_size=8).digest()
