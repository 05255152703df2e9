"""Stored responses (``store``, ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``):
one Redis key per response holding its input items, its response object, the response it
continued and the API key that made it, expiring after ``responses_ttl_s``.

A conversation is the chain of its responses: each stores only its own input and output, and a
continuation walks back through ``previous`` (at most ``MAX_CHAIN`` responses), so a long
conversation costs its length once, not once per turn. Only the API key that stored a response
reads, continues or deletes it (another key gets 404, as for a response that never was)."""

from __future__ import annotations

import json
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.errors import APIError
from shared import streams

MAX_CHAIN = 1024  # responses one continuation may walk back through


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
    ) -> None:
        record = {
            "owner": owner or "",
            "previous": response.get("previous_response_id"),
            "input": input_items,
            "response": response,
        }
        key = streams.response_key(response["id"])
        await _redis(self.redis.set(key, json.dumps(record), px=int(self.ttl_s * 1000)))

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

    async def history(self, response_id: str, owner: str | None) -> list[Any]:
        """The conversation up to and including ``response_id``: every input and output item
        of its chain, oldest first; 404 (``previous_response_id``) when a link is missing."""
        chain: list[dict[str, Any]] = []
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
                raise
            chain.append(record)
            next_id = record.get("previous")
        items: list[Any] = []
        for record in reversed(chain):
            items.extend(record["input"])
            items.extend(record["response"].get("output", []))
        return items


async def _redis(call: Any) -> Any:
    try:
        return await call
    except RedisError as exc:
        raise APIError(503, f"stored responses: {exc}", code="bus") from exc
