"""Stored responses (``store``, ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``):
one Redis key per response holding its input items, its response object, the response it
continued and the API key that made it, expiring after ``responses_ttl_s``.

A conversation is the chain of its responses: each stores only its own input and output and the
ids of the responses it continues (at most ``MAX_CHAIN``), so a continuation reads its whole
chain in two round trips and a long conversation's text is stored once, not once per turn.
Saving a continuation gives every response of its chain the full TTL again, in the same
transaction: a response that can be read can be continued (each kept its own TTL before, so a
conversation broke an hour after its first turn however recently it was used). Deleting a
response ends the conversations through it: a later turn's continuation is a 404 naming the
missing one. Only the API key that stored a response reads, continues or deletes it (another key
gets 404, as for a response that never was). A record also names the worker that served it: the
next turn prefers it, where its prefix cache holds the conversation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.errors import APIError, bus_error
from shared import streams

MAX_CHAIN = 1024  # responses one continuation may walk back through
# Bytes of stored records one continuation may read (far over any context's text): a chain of
# records fattened by unrendered fields is refused before it is read into the gateway.
MAX_CHAIN_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Conversation:
    """What a continuation needs of the stored chain it continues."""

    items: list[Any]  # every input and output item, oldest first
    response_ids: list[str]  # the chain, newest first
    worker_id: str | None  # the worker that served its newest response
    num_bytes: int = 0  # of its stored records


class ResponseStore:
    def __init__(self, redis: Redis, ttl_s: float, retry_after_s: int = 1) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s

    async def _redis(self, call: Any) -> Any:
        try:
            return await call
        except RedisError as exc:
            raise bus_error(f"stored responses: {exc}", self.retry_after_s) from exc

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
        chain_bytes: int = 0,
    ) -> None:
        """Store ``response`` and give the chain it continues (``chain_ids``, of
        ``chain_bytes`` stored bytes) the full TTL."""
        record: dict[str, Any] = {
            "owner": owner or "",
            "previous": response.get("previous_response_id"),
            "input": input_items,
            "response": response,
            "worker": worker_id,
            "chain": chain_ids,  # what it continues, newest first: read in one round trip
        }
        ttl_ms = int(self.ttl_s * 1000)
        encoded = json.dumps(record)
        record["chain_bytes"] = chain_bytes + len(encoded)  # a continuation checks it first
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(streams.response_key(response["id"]), json.dumps(record), px=ttl_ms)
            for response_id in chain_ids:
                pipe.pexpire(streams.response_key(response_id), ttl_ms)
            await self._redis(pipe.execute())

    async def load(self, response_id: str, owner: str | None) -> dict[str, Any]:
        """The stored record; 404 when there is none for this caller."""
        raw = await self._redis(self.redis.get(streams.response_key(response_id)))
        return _owned(response_id, raw, owner)

    async def delete(self, response_id: str, owner: str | None) -> None:
        await self.load(response_id, owner)  # 404 for another caller's
        await self._redis(self.redis.delete(streams.response_key(response_id)))

    async def history(self, response_id: str, owner: str | None) -> Conversation:
        """The conversation up to and including ``response_id``; 404 (``previous_response_id``)
        when a link is missing, naming it. Two round trips: the newest record names its chain."""
        try:
            newest = await self.load(response_id, owner)
            _check_chain_bytes(int(newest.get("chain_bytes", 0)))
            chain_ids = [response_id, *await self._older_ids(newest, owner)]
            if len(chain_ids) > MAX_CHAIN:
                raise APIError(
                    400,
                    f"the conversation is longer than {MAX_CHAIN} stored responses",
                    param="previous_response_id",
                )
            keys = [streams.response_key(i) for i in chain_ids[1:]]
            raws = await self._redis(self.redis.mget(keys)) if keys else []
            num_bytes = len(json.dumps(newest)) + sum(len(raw or b"") for raw in raws)
            _check_chain_bytes(num_bytes)  # records stored before they counted their chain
            chain = [newest]
            for older_id, raw in zip(chain_ids[1:], raws, strict=True):
                try:
                    chain.append(_owned(older_id, raw, owner))
                except APIError as exc:
                    exc.message += f" (an earlier turn of {response_id[:64]!r}: deleted or expired)"
                    raise
        except APIError as exc:
            exc.param = "previous_response_id"
            raise
        items: list[Any] = []
        for record in reversed(chain):
            items.extend(record["input"])
            items.extend(record["response"].get("output", []))
        return Conversation(items, chain_ids, newest.get("worker"), num_bytes)

    async def _older_ids(self, record: dict[str, Any], owner: str | None) -> list[str]:
        """The ids ``record`` continues, newest first: as it names them, or walked through
        ``previous`` for a record stored before records named their chain."""
        if "chain" in record:
            return list(record["chain"])
        older_ids: list[str] = []
        while (previous := record.get("previous")) is not None and len(older_ids) < MAX_CHAIN:
            older_ids.append(previous)
            raw = await self._redis(self.redis.get(streams.response_key(previous)))
            record = json.loads(raw) if raw is not None else {}
        return older_ids


def _check_chain_bytes(num_bytes: int) -> None:
    if num_bytes > MAX_CHAIN_BYTES:
        raise APIError(
            400,
            f"the conversation's stored responses take {num_bytes} bytes; a continuation reads "
            f"at most {MAX_CHAIN_BYTES}: start a new one",
            param="previous_response_id",
        )


def _owned(response_id: str, raw: bytes | str | None, owner: str | None) -> dict[str, Any]:
    """The record ``raw`` of ``response_id`` when ``owner`` stored it; else 404."""
    record = json.loads(raw) if raw is not None else None
    if record is None or record.get("owner") != (owner or ""):
        raise APIError(404, f"no stored response {response_id[:64]!r}", "response_id", "not_found")
    return dict(record)
