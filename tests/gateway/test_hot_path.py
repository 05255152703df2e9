"""The pieces on every request's path to its first token: SSE chunks from templates (the same
bytes as json.dumps of the whole chunk), the cached API key lookups and the dedicated Redis
connection (reconnects after a drop, stays in step after an error reply or a cancellation);
unknown keys remembered for a short TTL, at most so many."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from gateway.auth import API_KEYS_KEY, KEY_PREFIX, ApiKeyCache, create_api_key, delete_api_key
from gateway.bus import DedicatedConnection
from gateway.choices import Choice
from gateway.openai_routes import _chat_chunk, _completion_chunk
from gateway.sse import ChunkFormat

HEAD = {"id": "cmpl-0123abcd", "created": 1764547200, "model": "stories260K"}
TEXTS = ["", "Once", ' a "quoted" \\ path', "caf\u00e9 \U0001f600", "line\u2028sep\u0085\n\t\x00"]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_chunks_are_the_bytes_json_dumps_gives(chat: bool, include_usage: bool) -> None:
    generation = SimpleNamespace(stop_reason=None)
    choice = Choice(0, generation)  # type: ignore[arg-type]
    build = _chat_chunk(HEAD, choice) if chat else _completion_chunk(HEAD, choice)
    chunks = ChunkFormat(build, include_usage)
    generation.stop_reason = " was"  # known at the end: in the last chunk only
    for text in TEXTS:
        for reason in (None, "stop", "length"):
            expected = build(text, reason)
            if include_usage:
                expected["usage"] = None
            line = chunks.delta(text, reason)
            assert line == f"data: {json.dumps(expected)}\n\n".encode()
            assert line.isascii()
            assert json.loads(line[6:])["choices"][0]["stop_reason"] == (reason and " was")


async def test_api_keys_are_cached_until_the_version_changes(redis_client: Redis) -> None:
    cache = ApiKeyCache(redis_client)
    assert await cache.lookup("sk-si-unknown") is None
    key, info = await create_api_key(redis_client, "acme", "batch")
    assert await cache.lookup(key) == info  # never looked up before: found at once
    await cache.refresh()  # the create moved the version: emptied
    assert await cache.lookup(key) == info
    await redis_client.hdel(API_KEYS_KEY, *await redis_client.hkeys(API_KEYS_KEY))
    assert await cache.lookup(key) == info  # behind the cache's back: still served from it
    await cache.refresh()
    assert await cache.lookup(key) == info  # same version, same cache
    _, other = await create_api_key(redis_client, "other", None)
    assert await delete_api_key(redis_client, other.key_id)  # any create or delete bumps it
    await cache.refresh()
    assert await cache.lookup(key) is None


async def test_unknown_keys_are_remembered_briefly_and_boundedly(
    redis_client: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ApiKeyCache(redis_client, miss_ttl_s=0.3, max_misses=2)
    lookups: list[str] = []
    hget = redis_client.hget

    async def counted(name: str, field: str) -> Any:
        lookups.append(field)
        return await hget(name, field)

    monkeypatch.setattr(redis_client, "hget", counted)
    unknown = [f"{KEY_PREFIX}unknown-{n}" for n in range(3)]
    assert await cache.lookup(unknown[0]) is None
    assert await cache.lookup(unknown[0]) is None
    assert len(lookups) == 1  # the second time from the cache
    assert await cache.lookup("not-one-of-ours") is None
    assert await cache.lookup(KEY_PREFIX + "x" * 300) is None
    assert len(lookups) == 1  # tokens not shaped like our keys cost no round trip
    for key in unknown[1:]:
        assert await cache.lookup(key) is None
    assert cache.num_misses == 2  # bounded: the oldest (unknown[0]) was forgotten
    assert await cache.lookup(unknown[0]) is None and len(lookups) == 4
    await asyncio.sleep(0.35)
    assert await cache.lookup(unknown[0]) is None and len(lookups) == 5  # the TTL ran out
    await create_api_key(redis_client, "acme", None)
    await cache.refresh()  # a new version empties the misses too
    assert cache.num_misses == 0


async def test_dedicated_connection_recovers_from_drops_errors_and_cancels(
    redis_client: Redis,
) -> None:
    conn = DedicatedConnection(redis_client)
    try:
        entry_id = await conn.execute("XADD", "superinfer:test:s", "*", "m", b"x")
        assert entry_id.count(b"-") == 1
        client_id = await conn.execute("CLIENT", "ID")
        await redis_client.execute_command("CLIENT", "KILL", "ID", client_id)
        assert await conn.execute("PING") in (True, b"PONG")  # reconnected
        await redis_client.set("superinfer:test:text", "abc")
        with pytest.raises(ResponseError):
            await conn.execute("INCR", "superinfer:test:text")
        assert await conn.execute("PING") in (True, b"PONG")  # still in step
        with pytest.raises(ResponseError):
            await conn.execute_many(
                ("INCR", "superinfer:test:text"), ("SET", "superinfer:test:n", 1)
            )
        assert await conn.execute_many(("GET", "superinfer:test:n"), ("PING",)) in (
            [b"1", True],
            [b"1", b"PONG"],
        )  # every reply of the failed batch was read
        blocked = asyncio.create_task(
            conn.execute("XREAD", "BLOCK", 5000, "STREAMS", "superinfer:test:s", "$")
        )
        await asyncio.sleep(0.05)
        assert conn.busy
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        assert not conn.busy
        assert await conn.execute("PING") in (True, b"PONG")  # no reply left unread
    finally:
        await conn.close()
