"""Failed authentications (a wrong admin token, a missing or unknown API key where one is
required): counted, logged at a bounded rate and slowed, per source address.

The rule, per source (the client's address; behind a proxy, the proxy's):

- Every failure counts in ``superinfer:auth_failures_total{kind}``.
- The first ``free`` failures in a ``window_s`` window are answered at once (typos, a client
  with a stale key). Each further one in the window waits before its 401: 0.05 s, doubling
  with each failure, at most ``max_delay_s``. A client that waits for its answers (one that
  sends one guess at a time) is held to about one guess per ``max_delay_s`` per connection.
- While ``max_waiting_per_source`` of a source's failures are waiting (or ``max_waiting``
  of everyone's), its further failures get a 429 with Retry-After at once: the waits hold
  coroutines, never threads or the event loop, and their number is bounded.
- A success is never slowed, whatever its source did before.
- At most one log line (``auth_failures``, with the count since the last one) per source and
  kind per ``log_interval_s``.

The sources are an LRU of at most ``max_sources`` (the oldest forgotten first), so the state
stays bounded whatever addresses come. Many sources each under ``free``, or one client with
more connections than the caps, are beyond this rule: that is a proxy's or firewall's job."""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

import structlog
from fastapi import Request
from prometheus_client import Counter

from gateway.errors import APIError

log = structlog.get_logger(__name__)

FIRST_DELAY_S = 0.05


@dataclass(slots=True)
class _Source:
    window_start_s: float
    failures: int = 0  # within the window
    waiting: int = 0  # failures now held before their 401
    unlogged: int = 0
    logged_at_s: float = -math.inf


@dataclass(frozen=True, slots=True)
class FailureRule:
    free: int = 10
    window_s: float = 60.0
    max_delay_s: float = 2.0
    max_waiting_per_source: int = 64
    max_waiting: int = 1024
    log_interval_s: float = 10.0
    max_sources: int = 4096


class AuthFailures:
    """The failures of one gateway, by source (see the module's rule)."""

    def __init__(self, counter: Counter, rule: FailureRule | None = None) -> None:
        self.counter = counter
        self.rule = rule or FailureRule()
        self._sources: OrderedDict[tuple[str, str], _Source] = OrderedDict()
        self._waiting = 0

    @property
    def num_sources(self) -> int:
        return len(self._sources)

    async def failed(self, request: Request, kind: str, error: APIError) -> APIError:
        """Count, log and slow one failure of ``kind``; returns ``error`` to raise, or a 429
        when the source (or everyone) has too many failures waiting already."""
        self.counter.labels(kind=kind).inc()
        now = time.monotonic()
        address = request.client.host if request.client else "unknown"
        source = self._source((address, kind), now)
        source.failures += 1
        source.unlogged += 1
        delay = self._delay(source.failures)
        self._log(address, kind, source, now, delay)
        if delay <= 0:
            return error
        if source.waiting >= self.rule.max_waiting_per_source or (
            self._waiting >= self.rule.max_waiting
        ):
            retry = str(max(1, math.ceil(self.rule.max_delay_s)))
            message = "too many failed authentications from this address; retry later"
            return APIError(429, message, code="auth_throttled", headers={"Retry-After": retry})
        source.waiting += 1
        self._waiting += 1
        try:
            await asyncio.sleep(delay)
        finally:
            source.waiting -= 1
            self._waiting -= 1
        return error

    def _source(self, key: tuple[str, str], now: float) -> _Source:
        source = self._sources.get(key)
        if source is None:
            while len(self._sources) >= self.rule.max_sources:
                self._sources.popitem(last=False)  # the least recently failed
            source = self._sources[key] = _Source(window_start_s=now)
        else:
            self._sources.move_to_end(key)
        if now - source.window_start_s >= self.rule.window_s:
            source.window_start_s, source.failures = now, 0
        return source

    def _delay(self, failures: int) -> float:
        excess = failures - self.rule.free
        if excess <= 0:
            return 0.0
        return min(self.rule.max_delay_s, FIRST_DELAY_S * 2.0 ** min(excess - 1, 30))

    def _log(self, address: str, kind: str, source: _Source, now: float, delay: float) -> None:
        if now - source.logged_at_s < self.rule.log_interval_s:
            return
        log.warning(
            "auth_failures",
            kind=kind,
            source=address,
            failures=source.unlogged,
            in_window=source.failures,
            delay_s=round(delay, 3),
        )
        source.unlogged, source.logged_at_s = 0, now
