"""This gateway's heartbeat in ``superinfer:gateways``, written from a thread of its own with
its own Redis connection: a busy or blocked event loop (a slow request, a slow refresh) cannot
hold it back, so no worker calls a live gateway dead (data_plane/orphans.py)."""

from __future__ import annotations

import threading
import time

import structlog
from redis import Redis, RedisError

from shared import streams

log = structlog.get_logger(__name__)


class Heartbeat:
    def __init__(self, redis_url: str, gateway_id: str, every_s: float, timeout_s: float) -> None:
        self.gateway_id = gateway_id
        self.every_s = every_s
        self._redis = Redis.from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def beat(self) -> None:
        """One heartbeat: unix seconds (raises RedisError)."""
        self._redis.hset(streams.GATEWAYS_KEY, self.gateway_id, f"{time.time():.3f}")

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self.beat()
            except RedisError as exc:
                if not failing:  # once per outage
                    log.warning("gateway_heartbeat_failed", error=str(exc))
                failing = True
            else:
                if failing:
                    log.info("gateway_heartbeat_restored")
                failing = False
            self._stop.wait(self.every_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop beating (the last beat stays: workers judge by its age) and close the
        connection."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._redis.close()
