"""Stored responses count the bytes of their chain: a continuation whose chain of stored
records is over ``MAX_CHAIN_BYTES`` is a 400 before the chain is read into the gateway (records
fattened by fields no prompt renders grew a gateway by 680 MB for 8 continuations)."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from gateway import response_store
from gateway.errors import APIError
from gateway.response_store import ResponseStore


def _response(response_id: str, previous: str | None, text: str) -> dict[str, object]:
    return {"id": response_id, "previous_response_id": previous, "output": [{"text": text}]}


async def test_a_chain_over_its_byte_bound_is_refused_before_it_is_read(
    redis_client: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ResponseStore(redis_client, ttl_s=60)
    chain: list[str] = []
    num_bytes = 0
    for turn in range(4):
        response_id = f"resp_{turn}"
        previous = chain[0] if chain else None
        await store.save(
            _response(response_id, previous, "x" * 1000), [], "k", None, chain, num_bytes
        )
        conversation = await store.history(response_id, "k")
        assert conversation.response_ids[0] == response_id and len(conversation.items) == turn + 1
        assert conversation.num_bytes > num_bytes + 1000  # this turn's record counted
        chain, num_bytes = conversation.response_ids, conversation.num_bytes
    monkeypatch.setattr(response_store, "MAX_CHAIN_BYTES", num_bytes - 1)
    with pytest.raises(APIError, match="start a new one") as refused:
        await store.history(chain[0], "k")
    assert refused.value.param == "previous_response_id"
