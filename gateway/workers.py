"""The workers a gateway can route to: their heartbeat statuses (refreshed from Redis), the
requests this gateway queued on each, admission against per-worker bounds (requests, prompt
tokens, predicted seconds of prefill at each worker's measured rate), and routing to the
worker with the least predicted lag.

A worker is alive while its heartbeat keeps changing, timed on this gateway's monotonic clock
(a worker whose clock is seconds behind the gateway's was dead to it, every request failed);
only a status seen for the first time is aged by the wall clocks, so a stale entry left by a
dead worker is not taken for a live one. Knobs or SLO classes in Redis that do not validate are
logged and the last good ones kept (they took the gateway out of service)."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import structlog
from redis.asyncio import Redis

from gateway.errors import APIError
from gateway.settings import GatewaySettings
from shared import streams
from shared.knobs import read_knobs
from shared.policy import (
    Knobs,
    decode_step_s,
    kv_usage,
    least_loaded,
    predicted_lag_s,
    worker_for_key,
)
from shared.protocol import ProtocolError, WorkerStatus, decode
from shared.slo import DEFAULT_SLO_CLASSES, SloClass, read_slo_classes

log = structlog.get_logger(__name__)
T = TypeVar("T")
# Delete a worker's status (KEYS[1], field ARGV[1]) and its streams (KEYS[2..]) only while the
# status is still ARGV[2]: a worker that came back meanwhile keeps everything.
_FORGET = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""
FIRST_SIGHT_MAX_AGE_S = 3600.0  # a status older than this at first sight is as good as dead


@dataclass(frozen=True, slots=True)
class _Beat:
    """A worker incarnation's heartbeat value and when this gateway saw it change."""

    epoch: str
    t_heartbeat_s: float  # the worker's clock
    t_seen_mono_s: float  # this gateway's monotonic clock
    t_still_mono_s: float  # when this gateway first saw this value (never backdated)


@dataclass(slots=True)
class QueueShare:
    """Requests this gateway sent to one worker that have no first token yet."""

    num_requests: int = 0
    num_prompt_tokens: int = 0


class WorkerDirectory:
    def __init__(self, redis: Redis, settings: GatewaySettings) -> None:
        self.redis = redis
        self.settings = settings
        self.statuses: dict[str, WorkerStatus] = {}
        self.queued: dict[str, QueueShare] = {}
        self.control_plane_alive = False
        self.knobs = Knobs()
        self.knobs_version = 0
        self.slo_classes: dict[str, SloClass] = dict(DEFAULT_SLO_CLASSES)
        self.slo_classes_version = 0
        self.redis_ok = False
        self.num_malformed = 0
        self._beats: dict[str, _Beat] = {}  # per worker id in ``statuses`` (bounded by it)
        # requests routed to each worker since its status last changed (routing's fresh part)
        self._sent_since_status: dict[str, int] = {}
        self._invalid: dict[str, str] = {}  # what, of knobs and classes, does not validate
        self._malformed: dict[Any, Any] = {}  # worker id -> its status that did not decode

    async def refresh(self) -> None:
        """One read of everything routing and readiness need (raises RedisError)."""
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(streams.WORKERS_KEY)
                pipe.exists(streams.CONTROL_PLANE_HEARTBEAT_KEY)
                raw_workers, cp_alive = await pipe.execute()
            knobs = await self._validated("knobs", read_knobs)
            classes = await self._validated("slo_classes", read_slo_classes)
        except Exception:
            self.redis_ok = False
            self.control_plane_alive = False  # not seen: its heartbeat is in Redis
            raise
        self.redis_ok = True
        if knobs is not None:
            self.knobs, self.knobs_version = knobs
        if classes is not None:
            self.slo_classes, self.slo_classes_version = classes
        self.control_plane_alive = bool(cp_alive)
        previous, self.statuses = self.statuses, self._decode_statuses(raw_workers)
        self._observe_beats()
        self._forget_counted_sends(previous)
        await self._forget_dead(raw_workers)

    async def _validated(self, what: str, read: Callable[[Redis], Awaitable[T]]) -> T | None:
        """``read(redis)``, or None (the last good value stays) when what Redis holds does not
        validate: logged once per new error, never a refresh failed."""
        try:
            value = await read(self.redis)
        except ValueError as exc:
            if self._invalid.get(what) != str(exc):
                self._invalid[what] = str(exc)
                log.error("stored_value_invalid", what=what, error=str(exc), kept="last good")
            return None
        self._invalid.pop(what, None)
        return value

    def _observe_beats(self) -> None:
        """Note, on this gateway's clock, each worker heartbeat that changed since the last
        refresh; a status seen for the first time is as old as the wall clocks say."""
        now_mono, now_wall = time.monotonic(), time.time()
        beats: dict[str, _Beat] = {}
        for worker_id, status in self.statuses.items():
            old = self._beats.get(worker_id)
            if old is not None and (old.epoch, old.t_heartbeat_s) == (
                status.epoch,
                status.t_heartbeat_s,
            ):
                beats[worker_id] = old
            elif old is not None:  # it beat (or restarted) since the last refresh
                beats[worker_id] = _Beat(status.epoch, status.t_heartbeat_s, now_mono, now_mono)
            else:
                age_s = min(max(0.0, now_wall - status.t_heartbeat_s), FIRST_SIGHT_MAX_AGE_S)
                beat = _Beat(status.epoch, status.t_heartbeat_s, now_mono - age_s, now_mono)
                beats[worker_id] = beat
        self._beats = beats

    def _forget_counted_sends(self, previous: dict[str, WorkerStatus]) -> None:
        """A worker's status rebuilt since the last refresh counts what was sent it before:
        its count of sends since starts again. Only its heartbeat time new, it is the same
        status re-stamped (workers rebuild theirs between steps, once a heartbeat period at
        most): the count goes on (reset, a burst went 12/0 to a worker that had 12 already)."""
        kept: dict[str, int] = {}
        for worker_id, num_sent in self._sent_since_status.items():
            status, old = self.statuses.get(worker_id), previous.get(worker_id)
            if status is not None and old is not None and _restamped(old, status):
                kept[worker_id] = num_sent
        self._sent_since_status = kept

    async def _forget_dead(self, raw_workers: dict[Any, Any]) -> None:
        """Delete the status and streams of each worker whose heartbeat stood still for
        ``worker_forget_s`` of this gateway's watching (killed and never back: with random
        pod names they piled up), each only while its status is still the one judged."""
        now = time.monotonic()
        limit_s = self.settings.worker_forget_s
        dead = [w for w, beat in self._beats.items() if now - beat.t_still_mono_s > limit_s]
        for worker_id in dead:
            raw = raw_workers.get(worker_id.encode(), raw_workers.get(worker_id))
            keys = [streams.WORKERS_KEY, *streams.worker_streams(worker_id)]
            if raw is not None and await self.redis.eval(_FORGET, len(keys), *keys, worker_id, raw):
                log.info("worker_forgotten", worker_id=worker_id, still_s=round(limit_s))

    def beat_age_s(self, status: WorkerStatus) -> float:
        """Seconds since ``status``'s worker was last seen beating, on this gateway's clock
        (a status this directory has not observed: its age by the wall clocks)."""
        beat = self._beats.get(status.worker_id)
        if beat is not None and (beat.epoch, beat.t_heartbeat_s) == (
            status.epoch,
            status.t_heartbeat_s,
        ):
            return time.monotonic() - beat.t_seen_mono_s
        return max(0.0, time.time() - status.t_heartbeat_s)

    def _decode_statuses(self, raw: dict[Any, Any]) -> dict[str, WorkerStatus]:
        """The statuses that decode; a malformed one is counted and logged once per value
        (not at every refresh, 4 times a second)."""
        statuses: dict[str, WorkerStatus] = {}
        malformed: dict[Any, Any] = {}
        for worker_id, data in raw.items():
            try:
                status = decode(data, WorkerStatus)
            except ProtocolError as exc:
                malformed[worker_id] = data
                if self._malformed.get(worker_id) != data:
                    self.num_malformed += 1
                    log.error("malformed_worker_status", worker_id=worker_id, error=str(exc))
                continue
            statuses[status.worker_id] = status
        self._malformed = malformed  # bounded by the hash
        return statuses

    def alive(self) -> list[WorkerStatus]:
        alive_s = self.settings.worker_alive_s
        return [s for s in self.statuses.values() if self.beat_age_s(s) <= alive_s]

    def routable(self) -> list[WorkerStatus]:
        """Live workers that take new requests (not draining), none silent for longer than
        ``worker_dead_s`` (its in-flight requests are being moved off it: a new one would be
        lost at once)."""
        dead_s = self.settings.worker_dead_s
        return [s for s in self.alive() if s.accepting and self.beat_age_s(s) <= dead_s]

    def worker_for_key(self, key: str) -> str | None:
        """The routable worker ``prompt_cache_key`` ``key`` prefers (its prefix cache holds what
        the key's earlier requests left), the same in every gateway."""
        return worker_for_key(key, [s.worker_id for s in self.routable()])

    def no_worker_error(self) -> APIError:
        """The 503 for a request no worker can take: Redis unreachable (``bus``: workers are
        reached through it) or no live worker (``no_worker``)."""
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        if not self.redis_ok:
            message, code = "the request bus (Redis) is unreachable", "bus"
        else:
            message, code = "no data-plane worker is available", "no_worker"
        return APIError(503, message, code=code, headers=retry)

    def max_model_len(self) -> int | None:
        lens = [s.max_model_len for s in self.alive()]
        return min(lens) if lens else None

    def predicted_lag_s(self, status: WorkerStatus) -> float:
        """The lag a new request would see there, its step time predicted by the worker's
        decode fit at the requests it would then hold (those of its status, those sent since
        and this one); without a fit, its recent step time (idle: its measured decode step).
        A measured decode step alone was the load it last ran: a worker left idle after a
        burst kept its steps at 24 requests and drew nothing more. Busy over its last status
        period, its mean step (prefill chunks and all) when longer. Not a number: last."""
        share = self.queued.get(status.worker_id, QueueShare())
        fitted_s = decode_step_s(
            status.decode_base_s, status.decode_s_per_request, self.num_requests(status) + 1
        )
        if fitted_s is None:
            step_s = max(status.iteration_time_s, status.decode_step_s)
        else:
            step_s = max(status.iteration_time_s, fitted_s)
        if not math.isfinite(step_s):
            return math.inf
        return predicted_lag_s(
            step_s,
            status.num_waiting_tokens + share.num_prompt_tokens,
            status.max_num_batched_tokens,
            kv_usage(status.num_hbm_blocks, status.num_free_hbm_blocks),
        )

    def choose(self, num_prompt_tokens: int, prefer: str | None = None) -> WorkerStatus:
        """The least-lagging worker with room in its queue (``prefer`` when it has room); 503
        without workers, 429 when every queue is full (both with Retry-After: when over the
        work bound, the predicted seconds until the soonest queue has room)."""
        candidates = self.routable()
        retry_after_s = self.settings.retry_after_s
        if not candidates:
            raise self.no_worker_error()
        waits = {s.worker_id: self._wait_for_room_s(s, num_prompt_tokens) for s in candidates}
        open_workers = [s for s in candidates if waits[s.worker_id] is None]
        if not open_workers:
            known = [w for w in waits.values() if w is not None]
            retry_after_s = max(retry_after_s, math.ceil(min(known)))
            raise APIError(
                429,
                "the server is at capacity; retry later",
                code="queue_full",
                headers={"Retry-After": str(retry_after_s)},
            )
        preferred = [s for s in open_workers if s.worker_id == prefer]
        return preferred[0] if preferred else self.least_loaded(open_workers)

    def least_loaded(self, candidates: list[WorkerStatus]) -> WorkerStatus:
        """The candidate a new request goes to (:func:`shared.policy.least_loaded`): each one's
        requests are what it last reported plus what this gateway sent it since."""
        lags_s = [self.predicted_lag_s(status) for status in candidates]
        num_requests = [self.num_requests(status) for status in candidates]
        return candidates[least_loaded(lags_s, num_requests)]

    def num_requests(self, status: WorkerStatus) -> int:
        """Requests on the worker: those of its status and those this gateway sent it since
        (a status with a new heartbeat starts that count again)."""
        reported = status.num_running + status.num_waiting + status.num_rotary
        return reported + self._sent_since_status.get(status.worker_id, 0)

    def _wait_for_room_s(self, status: WorkerStatus, num_prompt_tokens: int) -> float | None:
        """None when ``status``'s worker has room for the request; else about how long until
        it has (``retry_after_s`` when a count is full)."""
        share = self.queued.get(status.worker_id, QueueShare())
        limits = self.settings
        if (
            share.num_requests >= limits.max_queued_requests
            or share.num_prompt_tokens + num_prompt_tokens > limits.max_queued_prompt_tokens
        ):
            return float(limits.retry_after_s)
        queued = self.queued_prefill_tokens(status)
        if queued == 0:  # an idle queue takes even a request bigger than the bound
            return None
        work_s = self.prefill_s(status.worker_id, queued + num_prompt_tokens)
        over_s = work_s - limits.max_queued_work_s
        return over_s if over_s > 0 else None

    def queued_prefill_tokens(self, status: WorkerStatus) -> int:
        """Prompt tokens to prefill on the worker before a new request's: this gateway's queued
        ones, or the worker's count of its waiting tokens (every gateway's) when larger."""
        share = self.queued.get(status.worker_id, QueueShare())
        return max(share.num_prompt_tokens, status.num_waiting_tokens)

    def prefill_s(self, worker_id: str, num_tokens: int) -> float:
        """Predicted seconds to prefill ``num_tokens`` on the worker at its latest measured
        rate; 0 while it has none (not measured yet, or not known)."""
        status = self.statuses.get(worker_id)
        rate = 0.0 if status is None else status.prefill_tokens_per_s
        if not (math.isfinite(rate) and rate > 0.0):
            return 0.0
        return num_tokens / rate

    def enqueue(self, worker_id: str, num_prompt_tokens: int) -> None:
        """A request routed (or moved) to ``worker_id``: queued there until :meth:`dequeue`,
        and counted as sent since its status."""
        share = self.queued.setdefault(worker_id, QueueShare())
        share.num_requests += 1
        share.num_prompt_tokens += num_prompt_tokens
        sent = self._sent_since_status
        sent[worker_id] = sent.get(worker_id, 0) + 1

    def dequeue(self, worker_id: str, num_prompt_tokens: int) -> None:
        share = self.queued.get(worker_id)
        if share is not None:
            share.num_requests = max(0, share.num_requests - 1)
            share.num_prompt_tokens = max(0, share.num_prompt_tokens - num_prompt_tokens)
            if share.num_requests == 0:  # one entry per worker with requests queued, no more
                del self.queued[worker_id]


def _restamped(old: WorkerStatus, new: WorkerStatus) -> bool:
    """``new`` is ``old`` sent again with a new heartbeat time (a worker's cached status)."""
    return replace(old, t_heartbeat_s=0.0) == replace(new, t_heartbeat_s=0.0)
