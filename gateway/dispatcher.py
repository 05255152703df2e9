"""Requests out to workers, token outputs back: one reader task per gateway fans the messages
of its output stream out to the waiting responses, dropping what a redelivery repeats. The
submit, the reader's XREAD and the lifecycle writes each have a Redis connection of their own
(:mod:`gateway.bus`); a submit or write that finds its connection busy takes the pool.

When the reader has failed for ``bus_lost_after_s`` without a good read (Redis gone, not a blip),
the bus is lost: every request in flight ends with a 503 ``bus`` error at once (their outputs
have no way to arrive), and :attr:`Dispatcher.bus_lost_for_s` tells /health."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.bus import DedicatedConnection
from gateway.errors import APIError, bus_error
from gateway.inflight import InFlight, InFlightRequests, Route
from shared import streams
from shared.protocol import (
    AbortReplyStream,
    AbortRequest,
    SubmitRequest,
    TokenOutput,
    TokenOutputs,
    encode,
)
from shared.protocol.convert import stream_messages
from shared.protocol.limits import OUTPUT_LIMITS
from shared.runtime import loop_with_backoff

log = structlog.get_logger(__name__)
MAX_QUEUED_ABORTS = 65_536  # aborts waiting for Redis (a route each: a few MB at most)
BUS_LOST_AFTER_S = 2.0  # the reader failing this long without a good read: the bus is lost


class Dispatcher:
    """Writes requests to workers' streams and routes their outputs to the in-flight
    records (:class:`~gateway.inflight.InFlightRequests`; the generation service adds and
    releases them)."""

    def __init__(
        self,
        redis: Redis,
        gateway_id: str,
        block_ms: int,
        live: InFlightRequests,
        bus_lost_after_s: float = BUS_LOST_AFTER_S,
        retry_after_s: int = 1,
    ) -> None:
        self.redis = redis
        self.retry_after_s = retry_after_s  # on the 503 bus of requests ended by a lost bus
        self.gateway_id = gateway_id
        self.reply_stream = streams.gateway_outputs_stream(gateway_id)
        self.block_ms = block_ms
        self.live = live
        self.num_malformed = 0
        self.num_duplicates = 0
        self._last_id: Any = "$"
        self._to_abort: list[Route] = []  # overflowed, or an abort Redis refused: to send
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._submitter = DedicatedConnection(redis)  # the pool when a submit is in flight
        self._reader = DedicatedConnection(redis)
        self._recorder = DedicatedConnection(redis)  # lifecycle hashes, off the requests' path
        self.bus_lost_after_s = bus_lost_after_s
        self._t_failing_s: float | None = None  # monotonic: first failed read since a good one

    def start(self) -> None:
        self._task = asyncio.create_task(
            loop_with_backoff(self._read_once, self._stop, self._on_read_error)
        )

    @property
    def bus_lost_for_s(self) -> float | None:
        """Seconds the reader has failed, once that is ``bus_lost_after_s`` or more; None while
        the bus works (or has failed for less)."""
        if self._t_failing_s is None:
            return None
        failing_s = time.monotonic() - self._t_failing_s
        return failing_s if failing_s >= self.bus_lost_after_s else None

    async def _on_read_error(self, exc: RedisError) -> None:
        """Once the reader has failed long enough, end every request in flight with a 503
        ``bus`` error (a request that arrives later fails at its submit)."""
        if self._t_failing_s is None:
            self._t_failing_s = time.monotonic()
        lost_for_s = self.bus_lost_for_s
        if lost_for_s is None:
            return
        message = f"lost the request bus (Redis unreachable for {lost_for_s:.1f} s: {exc})"
        num_ended = sum(
            record.outputs.end(bus_error(message, self.retry_after_s)) for record in self.live
        )
        if num_ended:
            log.error("bus_lost", num_requests_ended=num_ended, seconds=round(lost_for_s, 1))

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

    async def abort_previous_incarnation(self, worker_ids: Iterable[str]) -> None:
        """This gateway's id beat before (a restart under a fixed id: compose, a pod's name):
        the previous incarnation's requests still run on the workers for nobody. Tell each
        worker to abort what goes to this reply stream, before anything is submitted here (a
        worker reads its stream in order: this gateway's requests come after)."""
        if not await self.redis.hexists(streams.GATEWAYS_KEY, self.gateway_id):
            return
        data = encode(AbortReplyStream(self.reply_stream))
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                stream = streams.worker_requests_stream(worker_id)
                pipe.xadd(stream, {"m": data}, maxlen=streams.MAXLEN_REQUESTS, approximate=True)
            await pipe.execute()
        log.info("previous_incarnation_aborted", gateway_id=self.gateway_id)

    async def submit(self, record: InFlight, request: SubmitRequest) -> None:
        """The request to its route's worker stream (the worker records its arrival and
        admission in the lifecycle hash; nothing else sits on this path)."""
        stream = streams.worker_requests_stream(record.route.worker_id)
        data, maxlen = encode(request), streams.MAXLEN_REQUESTS
        if self._submitter.busy:  # concurrent submits go through the pool, side by side
            entry_id = await self.redis.xadd(stream, {"m": data}, maxlen=maxlen, approximate=True)
        else:
            entry_id = await self._submitter.execute(
                "XADD", stream, "MAXLEN", "~", maxlen, "*", "m", data
            )
        record.entry_id = entry_id

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

    async def move(self, record: InFlight, request: SubmitRequest, route: Route) -> None:
        """Resubmit ``record``'s request on ``route`` (a new wire id), deleting its entry from
        the old worker's stream and telling the old worker to abort it, so a late or
        restarted old worker neither runs it again nor mixes in its tokens. The record is
        rerouted before the writes (a fast new worker's first output can arrive before this
        coroutine resumes, and must find it); the three writes are one MULTI/EXEC."""
        old_entry_id = record.entry_id
        old = self.live.reroute(record, route)
        old_stream = streams.worker_requests_stream(old.worker_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            if old_entry_id is not None:
                pipe.xdel(old_stream, old_entry_id)
            pipe.xadd(old_stream, {"m": encode(AbortRequest(old.wire_id))})
            pipe.xadd(
                streams.worker_requests_stream(route.worker_id),
                {"m": encode(replace(request, request_id=route.wire_id))},
                maxlen=streams.MAXLEN_REQUESTS,
                approximate=True,
            )
            results = await pipe.execute()
        if record.route is route:
            record.entry_id = results[-1]

    async def abort(self, route: Route) -> None:
        """Tell ``route``'s worker to drop that attempt (frees its blocks in every tier)."""
        await self.redis.xadd(
            streams.worker_requests_stream(route.worker_id),
            {"m": encode(AbortRequest(route.wire_id))},
            maxlen=streams.MAXLEN_REQUESTS,
            approximate=True,
        )

    def abort_after_next_read(self, route: Route) -> None:
        """Abort ``route`` once the next read of the output stream succeeded (an abort Redis
        refused: else the worker serves the request for nobody to its end); at most
        ``MAX_QUEUED_ABORTS`` wait, the oldest dropped first (logged)."""
        if len(self._to_abort) >= MAX_QUEUED_ABORTS:
            dropped = self._to_abort.pop(0)
            log.error("abort_dropped", request_id=dropped.wire_id, worker_id=dropped.worker_id)
        self._to_abort.append(route)

    async def _send_aborts(self) -> None:
        """Abort on their workers the requests whose clients fell a whole buffer behind (their
        response may be blocked writing to that client and never read the overflow itself)
        and those whose abort Redis refused. A Redis error keeps them for the next read."""
        while self._to_abort:
            await self.abort(self._to_abort[0])
            self._to_abort.pop(0)

    async def _read_once(self) -> None:
        if self._last_id == "$":
            newest: Any = await self.redis.xrevrange(self.reply_stream, count=1)
            self._last_id = newest[0][0] if newest else "0-0"
        last_id, block_ms = self._last_id, self.block_ms
        args = ("XREAD", "COUNT", 1024, "BLOCK", block_ms, "STREAMS", self.reply_stream, last_id)
        raw = await self._reader.execute(*args)
        self._t_failing_s = None
        response: Any = self.redis.response_callbacks["XREAD"](raw)
        outputs = stream_messages(response, TokenOutputs, "malformed_output_message", OUTPUT_LIMITS)
        for entry_id, batch in outputs:
            self._last_id = entry_id
            if batch is None:
                self.num_malformed += 1
            else:
                for msg in batch.outputs:
                    self._route(msg)
        await self._send_aborts()
        if response:
            # The responses just handed a message run first: their chunks go out before this
            # task's next XREAD (a write that wakes Redis) and before this task runs again.
            await asyncio.sleep(0)

    def _route(self, msg: TokenOutput) -> None:
        record = self.live.get(msg.request_id)
        if record is None:
            return  # finished, abandoned or moved: a late or duplicate message
        if msg.index < record.num_received:  # a redelivery repeats tokens we already have
            self.num_duplicates += 1
            skip = record.num_received - msg.index
            if skip >= len(msg.token_ids) and msg.finish_reason is None:
                return
            msg = replace(msg, index=record.num_received, token_ids=msg.token_ids[skip:])
        elif msg.index > record.num_received:
            log.error("output_gap", request_id=msg.request_id, index=msg.index)
            record.outputs.end(APIError(502, "output from the worker was lost", code="lost_output"))
        record.num_received = msg.index + len(msg.token_ids)
        if not record.outputs.put(msg):  # its client stopped reading: the worker need not go on
            error = APIError(503, "client is reading too slowly; request dropped", code="overflow")
            if record.outputs.end(error):
                self.abort_after_next_read(record.route)
