"""Requests out to workers, token outputs back: one reader task per gateway fans the messages
of its output stream out to the waiting responses, dropping what a redelivery repeats. The
submit, the reader's XREAD and the lifecycle writes each have a Redis connection of their own
(:mod:`gateway.bus`); a submit or write that finds its connection busy takes the pool."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, replace
from typing import Any

import structlog
from redis.asyncio import Redis

from gateway.bus import DedicatedConnection
from gateway.errors import APIError
from shared import streams
from shared.protocol import AbortRequest, SubmitRequest, TokenOutput, TokenOutputs, encode
from shared.protocol.convert import stream_messages
from shared.runtime import loop_with_backoff

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class RequestHandle:
    """One in-flight request's wire state, changed only by the :class:`Dispatcher` (its
    ``Generation`` owns the rest: parameters, placement, the worker it watches, the submit
    kept for a move). ``outputs`` is bounded: a client that stops reading while the worker
    keeps producing ends with ``overflowed`` set."""

    request_id: str
    worker_id: str
    num_prompt_tokens: int
    outputs: asyncio.Queue[TokenOutput]
    # The id the worker knows it by: the request id, with ".rN" appended when the request was
    # moved to another worker (outputs of an earlier attempt then find no handle).
    wire_id: str = ""
    entry_id: bytes | str | None = None  # its entry in the worker's request stream
    num_attempts: int = 1
    num_received: int = 0  # output tokens received so far (the next expected index)
    overflowed: bool = False
    failure: APIError | None = None  # set by the gateway (e.g. the worker died)
    lost_output: bool = False  # an output message is missing (index gap)
    done: bool = False


class Dispatcher:
    def __init__(self, redis: Redis, gateway_id: str, max_buffered: int, block_ms: int) -> None:
        self.redis = redis
        self.gateway_id = gateway_id
        self.reply_stream = streams.gateway_outputs_stream(gateway_id)
        self.max_buffered = max_buffered
        self.block_ms = block_ms
        self.handles: dict[str, RequestHandle] = {}
        self.num_malformed = 0
        self.num_duplicates = 0
        self._last_id: Any = "$"
        self._overflowed: list[RequestHandle] = []  # to abort on their workers
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._submitter = DedicatedConnection(redis)  # the pool when a submit is in flight
        self._reader = DedicatedConnection(redis)
        self._recorder = DedicatedConnection(redis)  # lifecycle hashes, off the requests' path

    def start(self) -> None:
        self._task = asyncio.create_task(loop_with_backoff(self._read_once, self._stop))

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for conn in (self._submitter, self._reader, self._recorder):
            with contextlib.suppress(Exception):
                await conn.close()
        with contextlib.suppress(Exception):
            await self.redis.delete(self.reply_stream)

    def open(self, request_id: str, worker_id: str, num_prompt_tokens: int) -> RequestHandle:
        handle = RequestHandle(
            request_id, worker_id, num_prompt_tokens, asyncio.Queue(self.max_buffered), request_id
        )
        self.handles[request_id] = handle
        return handle

    def fail(self, handle: RequestHandle, error: APIError) -> None:
        """End ``handle`` with ``error`` (its consumer raises it at its next read)."""
        handle.failure = error
        with contextlib.suppress(asyncio.QueueFull):
            handle.outputs.put_nowait(TokenOutput(handle.request_id, -1, []))  # a wake-up

    def release(self, handle: RequestHandle) -> None:
        handle.done = True
        self.handles.pop(handle.wire_id, None)

    async def submit(self, handle: RequestHandle, request: SubmitRequest) -> None:
        """The request to the worker's stream (the worker records its arrival and admission
        in the lifecycle hash; nothing else sits on this path)."""
        stream, data = streams.worker_requests_stream(handle.worker_id), encode(request)
        maxlen = streams.MAXLEN_REQUESTS
        if self._submitter.busy:  # concurrent submits go through the pool, side by side
            entry_id = await self.redis.xadd(stream, {"m": data}, maxlen=maxlen, approximate=True)
        else:
            entry_id = await self._submitter.execute(
                "XADD", stream, "MAXLEN", "~", maxlen, "*", "m", data
            )
        handle.entry_id = entry_id

    async def record(self, request_id: str, fields: dict[str, str | float | int]) -> None:
        """``fields`` into the request's lifecycle hash (which expires after the TTL)."""
        key, ttl_s = streams.request_lifecycle_key(request_id), streams.LIFECYCLE_TTL_S
        if self._recorder.busy:  # concurrent records go through the pool, side by side
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
                pipe.expire(key, ttl_s)
                await pipe.execute()
            return
        flat = [item for pair in fields.items() for item in pair]
        await self._recorder.execute_many(("HSET", key, *flat), ("EXPIRE", key, ttl_s))

    async def move(self, handle: RequestHandle, request: SubmitRequest, worker_id: str) -> None:
        """Resubmit ``handle``'s request to ``worker_id`` under a new wire id, after deleting
        its entry from the old worker's stream and telling the old worker to abort it, so a
        late or restarted old worker neither runs it again nor mixes in its tokens."""
        old_stream = streams.worker_requests_stream(handle.worker_id)
        old_wire_id, old_entry_id = handle.wire_id, handle.entry_id
        handle.num_attempts += 1
        wire_id = f"{handle.request_id}.r{handle.num_attempts}"
        # Routed under the new id before the resubmit is written: a fast new worker's first
        # output can arrive before this coroutine resumes, and must find its request.
        self.handles.pop(old_wire_id, None)
        handle.wire_id, handle.worker_id, handle.entry_id = wire_id, worker_id, None
        handle.num_received = 0
        if not handle.done:
            self.handles[wire_id] = handle
        async with self.redis.pipeline(transaction=False) as pipe:
            if old_entry_id is not None:
                pipe.xdel(old_stream, old_entry_id)
            pipe.xadd(old_stream, {"m": encode(AbortRequest(old_wire_id))})
            pipe.xadd(
                streams.worker_requests_stream(worker_id),
                {"m": encode(replace(request, request_id=wire_id))},
                maxlen=streams.MAXLEN_REQUESTS,
                approximate=True,
            )
            results = await pipe.execute()
        handle.entry_id = results[-1]

    async def abort(self, handle: RequestHandle) -> None:
        """Tell the worker to drop the request (frees its blocks in every tier)."""
        await self.redis.xadd(
            streams.worker_requests_stream(handle.worker_id),
            {"m": encode(AbortRequest(handle.wire_id))},
            maxlen=streams.MAXLEN_REQUESTS,
            approximate=True,
        )

    async def _abort_overflowed(self) -> None:
        """Abort on their workers the requests whose clients fell a whole buffer behind (their
        response may be blocked writing to that client and never read the overflow itself).
        A Redis error keeps them for the next read."""
        while self._overflowed:
            await self.abort(self._overflowed[0])
            self._overflowed.pop(0)

    async def _read_once(self) -> None:
        if self._last_id == "$":
            newest: Any = await self.redis.xrevrange(self.reply_stream, count=1)
            self._last_id = newest[0][0] if newest else "0-0"
        last_id, block_ms = self._last_id, self.block_ms
        args = ("XREAD", "COUNT", 1024, "BLOCK", block_ms, "STREAMS", self.reply_stream, last_id)
        raw = await self._reader.execute(*args)
        response: Any = self.redis.response_callbacks["XREAD"](raw)
        for entry_id, batch in stream_messages(response, TokenOutputs, "malformed_output_message"):
            self._last_id = entry_id
            if batch is None:
                self.num_malformed += 1
            else:
                for msg in batch.outputs:
                    self._route(msg)
        await self._abort_overflowed()
        if response:
            # The responses just handed a message run first: their chunks go out before this
            # task's next XREAD (a write that wakes Redis) and before this task runs again.
            await asyncio.sleep(0)

    def _route(self, msg: TokenOutput) -> None:
        handle = self.handles.get(msg.request_id)
        if handle is None or handle.done:
            return  # finished or abandoned: a late or duplicate message
        if msg.index < handle.num_received:  # a redelivery repeats tokens we already have
            self.num_duplicates += 1
            skip = handle.num_received - msg.index
            if skip >= len(msg.token_ids) and msg.finish_reason is None:
                return
            msg = TokenOutput(
                handle.request_id,
                handle.num_received,
                msg.token_ids[skip:],
                msg.finish_reason,
                msg.error,
                msg.num_prompt_tokens,
                msg.t_first_run_s,
                msg.num_preemptions,
                msg.num_rotations,
                msg.error_kind,
            )
        elif msg.index > handle.num_received:
            handle.lost_output = True
            log.error("output_gap", request_id=msg.request_id, index=msg.index)
        handle.num_received = msg.index + len(msg.token_ids)
        try:
            handle.outputs.put_nowait(msg)
        except asyncio.QueueFull:
            if not handle.overflowed:  # its client stopped reading: the worker need not go on
                self._overflowed.append(handle)
            handle.overflowed = True
