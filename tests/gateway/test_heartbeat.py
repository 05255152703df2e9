"""A gateway's heartbeat (superinfer:gateways), written by its refresh loop, which workers
watch to abort its requests once it died (tests/data_plane/test_orphans.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from redis.asyncio import Redis

from gateway.state import GatewayState
from shared import streams


async def _nothing() -> None:
    return None


async def test_each_refresh_writes_the_gateway_heartbeat(redis_client: Redis) -> None:
    state = GatewayState.__new__(GatewayState)  # only what the refresh loop touches
    state.redis, state.gateway_id = redis_client, "gw-beat-test"
    state.settings = SimpleNamespace(directory_refresh_s=0.0)  # type: ignore[assignment]
    state.directory = SimpleNamespace(refresh=_nothing)  # type: ignore[assignment]
    state.api_keys = SimpleNamespace(refresh=_nothing)  # type: ignore[assignment]
    state.generations = SimpleNamespace(check_workers=_nothing)  # type: ignore[assignment]
    await state._refresh()
    first = await redis_client.hget(streams.GATEWAYS_KEY, "gw-beat-test")
    assert first is not None and abs(float(first) - time.time()) < 5
    time.sleep(0.002)
    await state._refresh()
    assert await redis_client.hget(streams.GATEWAYS_KEY, "gw-beat-test") != first  # it moves
