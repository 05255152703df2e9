"""Per-API-key limits, per gateway: concurrent requests and a request rate (a token bucket).
Beyond either: 429 with Retry-After."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from gateway.errors import APIError

_MIN_SWEEP = 1024  # keys held before idle buckets are first dropped


@dataclass(slots=True)
class _Bucket:
    tokens: float
    t_last_s: float
    num_active: int = 0


class KeyLimiter:
    def __init__(self, max_concurrent: int, max_requests_per_s: float) -> None:
        self.max_concurrent = max_concurrent
        self.rate_per_s = max_requests_per_s
        self.burst = max(1.0, max_requests_per_s)
        self._buckets: dict[str, _Bucket] = {}
        self._sweep_at = _MIN_SWEEP  # buckets held when idle full ones are next dropped

    def acquire(self, key_id: str) -> None:
        now = time.monotonic()
        if len(self._buckets) >= self._sweep_at:
            self._sweep(now)
        bucket = self._buckets.setdefault(key_id, _Bucket(self.burst, now))
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.t_last_s) * self.rate_per_s)
        bucket.t_last_s = now
        if bucket.num_active >= self.max_concurrent:
            raise _too_many(f"over {self.max_concurrent} concurrent requests for this key", 1)
        if bucket.tokens < 1.0:
            wait_s = (1.0 - bucket.tokens) / max(self.rate_per_s, 1e-9)
            raise _too_many(f"over {self.rate_per_s:g} requests/s for this key", wait_s)
        bucket.tokens -= 1.0
        bucket.num_active += 1

    def release(self, key_id: str) -> None:
        bucket = self._buckets.get(key_id)
        if bucket is not None:
            bucket.num_active = max(0, bucket.num_active - 1)

    def __len__(self) -> int:
        return len(self._buckets)

    def _sweep(self, now: float) -> None:
        """Drop the buckets of keys with nothing in flight whose tokens refilled (a new
        bucket is the same): one per key ever used (deleted keys too) would only grow. The
        next sweep waits until the held buckets doubled (amortized O(1) per request)."""
        idle = [
            key_id
            for key_id, b in self._buckets.items()
            if b.num_active == 0 and b.tokens + (now - b.t_last_s) * self.rate_per_s >= self.burst
        ]
        for key_id in idle:
            del self._buckets[key_id]
        self._sweep_at = max(_MIN_SWEEP, 2 * len(self._buckets))


def _too_many(message: str, retry_after_s: float) -> APIError:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    return APIError(429, message, code="rate_limited", headers=headers)
