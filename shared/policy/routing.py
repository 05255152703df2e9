"""Which worker gets a new request: pure functions over the numbers a worker reports."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

# Workers whose predicted lag is within this fraction of the least are equally good for a new
# request: the lag comes from measured step times (noisy, up to a heartbeat old), while the
# request counts include the router's own sends at once; among them the fewest requests wins.
LAG_TOLERANCE = 0.25


def kv_usage(num_blocks: int, num_free: int) -> float:
    """Fraction of a KV pool in use (0 for a pool with no blocks)."""
    return 0.0 if num_blocks <= 0 else 1.0 - num_free / num_blocks


def predicted_lag_s(
    step_s: float, num_queued_tokens: int, max_num_batched_tokens: int, hbm_usage: float
) -> float:
    """How long a new request would wait on a worker: the iterations it takes to drain the
    prompt tokens queued ahead of it, at ``step_s`` a step (the caller's prediction; never
    below 1 ms, or an idle worker's 0 drew every request of a burst), weighted up by HBM
    pressure (a full HBM pool admits by rotation, which is slower than into free blocks)."""
    iterations = 1.0 + num_queued_tokens / max(1, max_num_batched_tokens)
    return max(step_s, 1e-3) * iterations * (1.0 + hbm_usage)


def decode_step_s(base_s: float, per_request_s: float, num_requests: int) -> float | None:
    """A decode step's predicted time at ``num_requests`` (a worker's fit, data_plane/speed.py;
    None without one: nothing measured, or values no worker sends)."""
    if not (math.isfinite(base_s) and math.isfinite(per_request_s)):
        return None
    if base_s < 0.0 or per_request_s < 0.0 or base_s + per_request_s <= 0.0:
        return None
    return base_s + per_request_s * num_requests


def least_loaded(
    lags_s: Sequence[float], num_requests: Sequence[int], tolerance: float = LAG_TOLERANCE
) -> int:
    """Index of the worker a new request goes to: among those whose predicted lag is within
    ``tolerance`` of the least, the one holding the fewest requests (join-shortest-queue), then
    the least lag."""
    if not lags_s or len(lags_s) != len(num_requests):
        raise ValueError("one lag and one request count per worker, at least one worker")
    lags_s = [lag_s if math.isfinite(lag_s) else math.inf for lag_s in lags_s]  # NaN: last
    bound_s = min(lags_s) * (1.0 + tolerance)
    near = [i for i, lag_s in enumerate(lags_s) if lag_s <= bound_s]
    return min(near, key=lambda i: (num_requests[i], lags_s[i]))


def worker_for_key(key: str, worker_ids: list[str]) -> str | None:
    """The worker a cache key (``prompt_cache_key``) goes to: rendezvous hashing, so every
    gateway picks the same one without sharing state, and a worker joining or leaving moves
    only the keys that pick it (None without workers)."""
    if not worker_ids:
        return None
    return max(worker_ids, key=lambda worker_id: _score(key, worker_id))


def _score(key: str, worker_id: str) -> bytes:
    return hashlib.blake2b(f"{worker_id}\x00{key}".encode(), digest_size=8).digest()
