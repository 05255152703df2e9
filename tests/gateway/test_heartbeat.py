"""A gateway's heartbeat (superinfer:gateways), written by a thread of its own, which workers
watch to abort its requests once it died (tests/data_plane/test_orphans.py): it moves while
the event loop is blocked, and stays (its last value) once stopped."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from gateway.heartbeat import Heartbeat
from shared import streams
from tests.redis_support import redis_url


async def test_the_heartbeat_moves_while_the_event_loop_is_blocked(redis_client: Redis) -> None:
    heartbeat = Heartbeat(redis_url(), "gw-beat-test", every_s=0.05, timeout_s=5.0)
    heartbeat.start()
    try:
        seen = set()
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.06)  # blocks the loop, as a slow handler would
            value = await redis_client.hget(streams.GATEWAYS_KEY, "gw-beat-test")
            if value is not None:
                assert abs(float(value) - time.time()) < 5
                seen.add(value)
        assert len(seen) >= 3, seen
    finally:
        heartbeat.stop()
    last = await redis_client.hget(streams.GATEWAYS_KEY, "gw-beat-test")
    time.sleep(0.15)
    assert await redis_client.hget(streams.GATEWAYS_KEY, "gw-beat-test") == last  # stopped
    await redis_client.hdel(streams.GATEWAYS_KEY, "gw-beat-test")
