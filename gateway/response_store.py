"""Stored responses (``store``, ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``):
one Redis key per response holding its input items, its response object, the response it
continued and the API key that made it, expiring after ``responses_ttl_s``.

A conversation is the chain of its responses: each stores only its own input and output, and a
continuation walks back through ``previous`` (at most ``MAX_CHAIN`` responses), so a long
conversation costs its length once, not once per turn. Saving a continuation gives every
response of its chain the full TTL again, in the same transaction: a response that can be read
can be continued (each kept its own TTL before, so a conversation broke an hour after its first
turn however recently it was used). Deleting a response ends the conversations through it: a
later turn's continuation is a 404 naming the missing one. Only the API key that stored a
response reads, continues or deletes it (another key gets 404, as for a response that never
was). A record also names the worker that served it: the next turn prefers it, where its
prefix cache holds the conversation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.errors import APIError
from shared import streams

MAX_CHAIN = 1024  # responses one continuation may walk back through


@dataclass(frozen=True, slots=True)
class Conversation:
    """What a continuation needs of the stored chain it continues."""

    items: list[Any]  # every input and output item, oldest first
    response_ids: list[str]  # the chain, newest first
    worker_id: str | None  # the worker that served its newest response


class ResponseStore:
    def __init__(self, redis: Redis, ttl_s: float) -> None:
        self.redis = redis
        self.ttl_s = ttl_s

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    async def save(
        self,
        response: dict[str, Any],
        input_items: list[Any],
        owner: str | None,
        worker_id: str | None,
        chain_ids: list[str],
    ) -> None:
        """Store ``response`` and give the chain it continues (``chain_ids``) the full TTL."""
        record = {
            "owner": owner or "",
            "previous": response.get("previous_response_id"),
            "input": input_items,
            "response": response,
            "worker": worker_id,
        }
        ttl_ms = int(self.ttl_s * 1000)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(streams.response_key(response["id"]), json.dumps(record), px=ttl_ms)
            for response_id in chain_ids:
                pipe.pexpire(streams.response_key(response_id), ttl_ms)
            await _redis(pipe.execute())

    async def load(self, response_id: str, owner: str | None) -> dict[str, Any]:
        """The stored record; 404 when there is none for this caller."""
        raw = await _redis(self.redis.get(streams.response_key(response_id)))
        record = json.loads(raw) if raw is not None else None
        if record is None or record.get("owner") != (owner or ""):
            raise APIError(
                404, f"no stored response {response_id[:64]!r}", "response_id", "not_found"
            )
        return dict(record)

    async def delete(self, response_id: str, owner: str | None) -> None:
        await self.load(response_id, owner)  # 404 for another caller's
        await _redis(self.redis.delete(streams.response_key(response_id)))

    async def history(self, response_id: str, owner: str | None) -> Conversation:
        """The conversation up to and including ``response_id``; 404 (``previous_response_id``)
        when a link is missing, naming it."""
        chain: list[dict[str, Any]] = []
        chain_ids: list[str] = []
        next_id: str | None = response_id
        while next_id is not None:
            if len(chain) >= MAX_CHAIN:
                raise APIError(
                    400,
                    f"the conversation is longer than {MAX_CHAIN} stored responses",
                    param="previous_response_id",
                )
            try:
                record = await self.load(next_id, owner)
            except APIError as exc:
                exc.param = "previous_response_id"
                if next_id != response_id:
                    exc.message += f" (an earlier turn of {response_id[:64]!r}: deleted or expired)"
                raise
            chain.append(record)
            chain_ids.append(next_id)
            next_id = record.get("previous")
        items: list[Any] = []
        for record in reversed(chain):
            items.extend(record["input"])
            items.extend(record["response"].get("output", []))
        return Conversation(items, chain_ids, chain[0].get("worker"))


async def _redis(call: Any) -> Any:
    try:
        return await call
    except RedisError as exc:
        raise APIError(503, f"stored responses: {exc}", code="bus") from exc
