"""Requests whose gateway died: every gateway writes its heartbeat (unix seconds) into
``superinfer:gateways`` from its heartbeat thread; a worker watches those values and calls a gateway
dead once its value has not changed for ``gateway_dead_s`` of the worker's own watching. The
worker then aborts the requests it owns for that gateway, each ending with an error on the
gateway's output stream (:func:`sweep_orphans`, which the worker's loop calls between engine
steps). The stream stays until the gateway is forgotten (``gateway_forget_s``): a gateway that
was only stalled (a frozen process, a VM paused) reads, when it runs again, the outputs of the
requests that finished meanwhile and the errors of those aborted, instead of timing out.

Judging by change on the worker's monotonic clock, not by comparing the value with the
worker's wall clock, keeps clock skew between hosts out of it; a gap in the worker's own
watching (Redis away: nobody can beat then) restarts every gateway's count. A gateway that is
not in the hash (a client writing to the bus itself, or one forgotten) is never called dead.
A request from a gateway called dead is parked until the next poll: a gateway restarted with
its id (compose and Kubernetes restarts keep it) sends before this worker has seen it beat
again, and those requests were dropped (their clients waited 60 s for a 504); still dead then,
it is dropped.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
from redis.asyncio import Redis

from data_plane.engine.engine import Engine
from data_plane.grammar_intake import PendingGrammars
from data_plane.replies import Replies
from shared import streams
from shared.protocol import SubmitRequest, TokenOutput
from shared.protocol.limits import MAX_ERROR_CHARS

log = structlog.get_logger(__name__)
MAX_PARKED = 4096  # requests of gateways called dead held for one poll (more are dropped)


class GatewayWatch:
    def __init__(self, dead_s: float, forget_s: float) -> None:
        self.dead_s = dead_s
        self.forget_s = forget_s
        self._seen: dict[str, tuple[bytes, float]] = {}  # gateway -> (beat, when it changed)
        self._t_polled_s: float | None = None  # monotonic time of the last successful poll
        self.dead: set[str] = set()  # until they beat again or leave the hash
        self.unswept: set[str] = set()  # dead, their requests not yet aborted
        self.num_polls = 0
        self._parked: list[tuple[int, SubmitRequest]] = []  # (num_polls when parked, request)

    async def poll(self, redis: Redis) -> None:
        """Read the heartbeats and update :attr:`dead` (raises RedisError)."""
        raw: Any = await redis.hgetall(streams.GATEWAYS_KEY)
        self.observe({_text(k): v for k, v in raw.items()}, time.monotonic())
        stale = [gw for gw, beat in self._beats(raw) if time.time() - beat > self.forget_s]
        if stale:
            # the output streams only of those this worker called dead (by its own watching,
            # never by comparing clocks): a live gateway's stream is never deleted
            dead = [gw for gw in stale if gw in self.dead]
            async with redis.pipeline(transaction=True) as pipe:
                pipe.hdel(streams.GATEWAYS_KEY, *stale)
                if dead:
                    pipe.delete(*(streams.gateway_outputs_stream(gw) for gw in dead))
                await pipe.execute()
            log.info("gateways_forgotten", gateway_ids=stale)

    def observe(self, beats: dict[str, bytes], now_s: float) -> None:
        """One poll's heartbeats (gateway id -> value), seen at monotonic ``now_s``."""
        self.num_polls += 1
        gap = self._t_polled_s is None or now_s - self._t_polled_s > self.dead_s / 2
        if gap and self._t_polled_s is not None and self._seen:
            log.info(
                "gateway_watch_gap",
                gap_s=round(now_s - self._t_polled_s, 3),
                reason="this worker did not watch; silence restarts counting for every gateway",
            )
        self._t_polled_s = now_s
        for gateway_id, beat in beats.items():
            seen = self._seen.get(gateway_id)
            if seen is None or seen[0] != beat:
                self._seen[gateway_id] = (beat, now_s)
                if gateway_id in self.dead:
                    log.warning("gateway_beats_again", gateway_id=gateway_id)
                self.dead.discard(gateway_id)
                self.unswept.discard(gateway_id)
            elif gap:  # we were not watching: what we missed is no evidence of death
                self._seen[gateway_id] = (beat, now_s)
            elif now_s - seen[1] >= self.dead_s and gateway_id not in self.dead:
                self._judge_dead(gateway_id, beat, now_s - seen[1])
                self.dead.add(gateway_id)
                self.unswept.add(gateway_id)
        for gateway_id in set(self._seen) - set(beats):  # left the hash: unknown again
            del self._seen[gateway_id]
            self.dead.discard(gateway_id)
            self.unswept.discard(gateway_id)

    def _judge_dead(self, gateway_id: str, beat: bytes, silent_s: float) -> None:
        """Log why ``gateway_id`` is called dead: its heartbeat stood still while watched."""
        try:
            age = f", {time.time() - float(beat):.1f} s old by this worker's clock"
        except ValueError:
            age = ""
        reason = (
            f"heartbeat {_text(beat)!r}{age} unchanged for {silent_s:.1f} s of continuous "
            f"watching (limit gateway_dead_s {self.dead_s:g} s); its requests will be aborted"
        )
        log.warning(
            "gateway_dead",
            gateway_id=gateway_id,
            silent_s=round(silent_s, 3),
            last_beat=_text(beat),
            dead_s=self.dead_s,
            reason=reason,
        )

    def owns_dead(self, reply_stream: str) -> bool:
        """``reply_stream`` belongs to a gateway called dead."""
        return streams.gateway_of_outputs_stream(reply_stream) in self.dead

    def park(self, request: SubmitRequest) -> bool:
        """Hold a request of a gateway called dead until the next poll (:meth:`unparked`);
        False when too many are held (the caller drops it)."""
        if len(self._parked) >= MAX_PARKED:
            log.warning("request_of_dead_gateway_dropped", request_id=request.request_id)
            return False
        self._parked.append((self.num_polls, request))
        return True

    def unparked(self) -> tuple[list[SubmitRequest], list[SubmitRequest]]:
        """The parked requests whose gateway beat again in a poll since they were parked, and
        those dropped because it is still dead then (logged); the rest stay."""
        revived, dropped, waiting = [], [], []
        for parked_at, request in self._parked:
            if parked_at == self.num_polls:
                waiting.append((parked_at, request))
            elif self.owns_dead(request.reply_stream):
                log.warning("request_of_dead_gateway_dropped", request_id=request.request_id)
                dropped.append(request)
            else:
                revived.append(request)
        self._parked = waiting
        return revived, dropped

    @staticmethod
    def _beats(raw: dict[bytes, bytes]) -> list[tuple[str, float]]:
        beats = []
        for key, value in raw.items():
            try:
                beats.append((_text(key), float(value)))
            except ValueError:  # not written by a gateway: forgotten with the stale ones
                beats.append((_text(key), 0.0))
        return beats


def orphaned_error(reply_stream: str, dead_s: float) -> str:
    """The error a request of a gateway called dead ends with (read if that gateway was only
    frozen and runs again)."""
    gateway_id = streams.gateway_of_outputs_stream(reply_stream) or reply_stream
    message = f"aborted by the worker: gateway {gateway_id} sent no heartbeat for {dead_s:g} s"
    return message[:MAX_ERROR_CHARS]


def sweep_orphans(
    watch: GatewayWatch, engine: Engine, replies: Replies, grammars: PendingGrammars
) -> None:
    """Abort the requests of the gateways called dead, between engine steps (after the last
    step's outputs went out), those whose grammar still compiles too; each ends with an error
    on its reply stream (sent with the next outputs), read if its gateway comes back."""
    dead = set(watch.unswept)
    orphans = [
        (request_id, stream)
        for request_id, stream in replies.reply_streams().items()
        if streams.gateway_of_outputs_stream(stream) in dead
    ]
    for request_id, stream in orphans:
        engine.abort(request_id)
        replies.orphan(request_id, orphaned_error(stream, watch.dead_s))
    for gateway_id in dead:
        stream = streams.gateway_outputs_stream(gateway_id)
        for request_id in grammars.drop_for(stream):
            end_orphan(replies, request_id, stream, watch.dead_s)
            orphans.append((request_id, stream))
    watch.unswept -= dead
    log.warning(
        "orphans_aborted",
        gateway_ids=sorted(dead),
        request_ids=[request_id for request_id, _ in orphans],
        reason="their gateway was called dead (see gateway_dead)",
    )


def end_orphan(replies: Replies, request_id: str, reply_stream: str, dead_s: float) -> None:
    """End a request of a gateway called dead that the engine never owned (parked, or its
    grammar compiling) with the orphaned error on its reply stream."""
    error = orphaned_error(reply_stream, dead_s)
    end = TokenOutput(request_id, 0, [], "error", error, error_kind="orphaned")
    replies.reject(reply_stream, end)


def abort_reply_stream(
    reply_stream: str, engine: Engine, replies: Replies, grammars: PendingGrammars
) -> list[str]:
    """Abort every request this worker owns whose outputs go to ``reply_stream`` (its gateway
    restarted under its id: nobody reads them); returns their ids."""
    orphans = [rid for rid, stream in replies.reply_streams().items() if stream == reply_stream]
    for request_id in orphans:
        engine.abort(request_id)
        replies.orphan(request_id)
    orphans += grammars.drop_for(reply_stream)
    replies.drop_stream(reply_stream)
    if orphans:
        log.warning(
            "orphans_aborted",
            reply_stream=reply_stream,
            request_ids=orphans,
            reason="their gateway restarted under its id",
        )
    return orphans


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
