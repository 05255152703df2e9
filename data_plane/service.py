"""`superinfer data-plane`: the engine as an asyncio service on Redis streams.

Each loop: take new requests from this worker's stream through its consumer group (pending
ones of an earlier incarnation first; XACK and XDEL once the engine owns a request, so a crash
before that leaves it pending for redelivery: :mod:`data_plane.intake`), abort the requests of
gateways that stopped heartbeating (:mod:`data_plane.orphans`), take the newest plan, set
B_xfer from the plan the step will run (the remote one's budget, else the locally resolved
one: its one writer), run one engine iteration in a thread, publish token outputs to each
request's reply stream and the iteration's snapshot to the control plane. The knobs come from
Redis only: the worker's flags seed them where Redis has none, before its first step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from typing import Any, TypeVar, cast

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from data_plane.admission import Admission
from data_plane.engine.engine import Engine
from data_plane.engine.request import FinishReason, RequestOutput
from data_plane.grammar_intake import PendingGrammars
from data_plane.intake import Entry, Intake
from data_plane.knobs import WorkerKnobs
from data_plane.orphans import GatewayWatch, abort_reply_stream, sweep_orphans
from data_plane.outbox import Outbox
from data_plane.planner import HybridPlanner
from data_plane.replies import Replies
from data_plane.reports import WorkerIdentity, worker_status
from data_plane.settings import WorkerSettings
from data_plane.speed import SpeedMeter
from data_plane.stall import StepWatch
from shared import streams
from shared.b_xfer import resolve_b_xfer_blocks
from shared.model_source import model_display_name
from shared.protocol import (
    AbortReplyStream,
    AbortRequest,
    Limits,
    ProtocolError,
    RotationPlan,
    SubmitRequest,
    WorkerStatus,
    decode,
    encode,
)
from shared.protocol.convert import stream_messages
from shared.runtime import (
    collect_due_garbage,
    garbage_collected_between_iterations,
    loop_with_backoff,
)

GRAMMAR_POLL_MS = 5  # an idle worker's read while a grammar compiles
log = structlog.get_logger(__name__)
T = TypeVar("T")
Fetched = list[T] | Exception  # a read's result, or the error it raised
MAX_FAILED_STEPS = 3  # consecutive engine steps that raised before every request is failed


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        planner: HybridPlanner,
        redis: Redis,
        block_bytes: int,
    ) -> None:
        """``engine``: built around ``planner`` for serving (``data_plane.main.build_worker``:
        columnar snapshots kept for the wire, unix-second clock, no tokenizer)."""
        self.settings = settings
        self.engine = engine
        self.planner = planner
        self.redis = redis
        self.block_bytes = block_bytes
        self.epoch = planner.epoch
        self.model_name = settings.served_model_name or model_display_name(settings.model)
        self.intake = Intake(redis, settings.worker_id, settings.read_batch)
        # the largest legal request
        self.limits = Limits.for_prompts(engine.max_model_len, engine.vocab_size or 0)
        self.gateways = GatewayWatch(settings.gateway_dead_s, settings.gateway_forget_s)
        self.grammars = PendingGrammars(engine.compile_grammar, engine.grammar_ready)
        self.plans_stream = streams.worker_plans_stream(settings.worker_id)
        self.replies = Replies()  # where each owned request's outputs go
        self.admission = Admission(
            engine, self.replies, self.gateways, self.grammars, settings.worker_id
        )
        self._last_plan_id = "0-0"
        self.knobs = WorkerKnobs(redis, planner)  # read by the heartbeat, applied between steps
        self._iteration_time_s = 0.0  # the last step's, for a local B_xfer of "auto"
        self._last_heartbeat_s = 0.0
        self._busy_time_s = 0.0  # iteration time summed since the last heartbeat
        self._busy_iterations = 0
        self.speed = SpeedMeter()  # measured prefill rate and decode step time, for gateways
        self.step_watch = StepWatch(settings.step_stall_s)  # a hung step stops the heartbeat
        # Set on SIGTERM: new requests stay pending in the stream (the next incarnation reads
        # them) and gateways stop routing here; aborts are still honoured.
        self.draining = False
        self.num_iterations = 0
        self.num_malformed = 0
        self._num_failed_steps = 0
        self.identity = WorkerIdentity(settings.worker_id, self.epoch, block_bytes)
        # The last step's snapshot and outputs on their way to Redis while the next step runs.
        deltas = settings.snapshot_deltas
        self.outbox = Outbox(
            redis, self.replies, planner, engine.kv, self.identity, snapshot_deltas=deltas
        )
        self._status_cache = self._status(time.time())  # rebuilt between steps

    @property
    def status(self) -> WorkerStatus:
        """The status as last rebuilt between steps (heartbeats send it with a fresh time)."""
        return self._status_cache

    async def run(self, stop: asyncio.Event) -> None:
        log.info("worker_started", worker_id=self.settings.worker_id, epoch=self.epoch)
        self._status_cache = self._status(time.time())
        with contextlib.suppress(RedisError):  # an earlier incarnation's streams are ours again
            for stream in self._own_streams():
                await self.redis.persist(stream)
        # Heartbeats run beside the loop: a long engine step (it runs in a thread) must not
        # make gateways think this worker died.
        beat = asyncio.create_task(loop_with_backoff(self._heartbeat, stop))
        try:
            with garbage_collected_between_iterations():
                await loop_with_backoff(self._iterate, stop, self._after_redis_error)
        finally:
            self.grammars.close()
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
        with contextlib.suppress(RedisError):
            await self.outbox.flush()  # the last step's outputs
            await self.intake.ack()  # what a failed acknowledgement left
            if self.replies.has_pending:  # a last try for what a failed write left
                await self.replies.send(self.redis, [])
            await self.redis.hdel(streams.WORKERS_KEY, self.settings.worker_id)
            await self.redis.zrem(streams.SNAPSHOT_WORKERS_KEY, self.settings.worker_id)
            ttl_s = max(1, round(self.settings.stopped_streams_ttl_s))
            for stream in self._own_streams():  # gone unless this id comes back in time
                await self.redis.expire(stream, ttl_s)
        log.info("worker_stopped", worker_id=self.settings.worker_id)

    def _own_streams(self) -> tuple[str, str]:
        """The streams nobody else deletes once this worker left the workers hash: its
        requests (pending ones wait for its next incarnation) and its plans."""
        return self.intake.stream, self.plans_stream

    def has_unfinished(self) -> bool:
        """Requests this worker owns and has not finished: in the engine, or acknowledged and
        waiting for their grammar to compile (they join the engine between steps)."""
        return self.engine.has_unfinished() or len(self.grammars) > 0

    async def _after_redis_error(self, exc: RedisError) -> None:
        if "NOGROUP" in str(exc) or "no longer exists" in str(exc):
            await self.intake.ensure_group()

    async def _iterate(self) -> None:
        """One iteration: with requests in flight, the engine step runs in its thread while
        new requests and plans are read (no Redis round trip between steps); what was read is
        applied once the step is done, so the engine and the planner change between steps
        only. Idle, the read blocks up to ``idle_block_ms`` (it also paces retries of a failed
        write)."""
        if not self.knobs.seeded:
            await self.knobs.seed()
        if self.engine.has_unfinished():
            step = asyncio.create_task(self._step())
            try:
                fetched = await self._fetch(block_ms=None)
            except BaseException:  # cancelled: the step still ends before the worker stops
                await asyncio.gather(step, return_exceptions=True)
                raise
            try:
                await step
            finally:  # even after a failed step: what was read must not sit unacknowledged
                await self._apply(*fetched)
        else:  # idle; a grammar compiling: its request joins within a few ms of being ready
            idle_ms = GRAMMAR_POLL_MS if len(self.grammars) else self.settings.idle_block_ms
            fetched = await self._fetch(block_ms=idle_ms)
            try:
                if self.replies.has_pending:  # lifecycle fields, or what a failed write left
                    await self.outbox.flush()
                    await self.replies.send(self.redis, [])
            finally:  # a failed write again: what was read is still taken
                await self._apply(*fetched)
        if self.gateways.unswept:
            await self.outbox.flush()  # the last step's outputs first: a finish is never lost
            sweep_orphans(self.gateways, self.engine, self.replies, self.grammars)
        self.admission.take_waiting()
        self.knobs.apply()  # the planner changes between steps only
        self._refresh_status()
        collect_due_garbage()  # between iterations, not inside a step or the plan round trip

    async def _fetch(self, block_ms: int | None) -> tuple[Fetched[Entry], Fetched[RotationPlan]]:
        """New request entries and plans, read at once (one wait for Redis); each read's
        error is returned in its place, so what the other read got is still applied."""
        entries, plans = await asyncio.gather(
            self.intake.read(block_ms), self._read_plans(), return_exceptions=True
        )
        for result in (entries, plans):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # cancelled: the worker stops
        return cast(Fetched[Entry], entries), cast(Fetched[RotationPlan], plans)

    async def _apply(self, entries: Fetched[Entry], plans: Fetched[RotationPlan]) -> None:
        """Between steps: the plans to the planner, the requests to the engine (handled entries
        acknowledged); then a failed read's error is raised (its entries stay pending)."""
        if not isinstance(plans, Exception):
            self._offer_plans(plans)
        if not isinstance(entries, Exception):
            self._take_requests(entries)
        await self.intake.ack()
        for result in (entries, plans):
            if isinstance(result, Exception):
                raise result

    async def _step(self) -> None:
        self._set_b_xfer()
        t_start = time.perf_counter()
        self.step_watch.started()
        try:
            result = await asyncio.to_thread(self.engine.step)
        except Exception as exc:  # a bug: never loop on it with requests hanging
            self.step_watch.ended(time.perf_counter() - t_start)
            await self._fail_all(exc)
            raise
        self._num_failed_steps = 0
        self.num_iterations += 1
        iteration_time_s = time.perf_counter() - t_start
        self.step_watch.ended(iteration_time_s)
        self._iteration_time_s = iteration_time_s
        self._busy_time_s += iteration_time_s
        self._busy_iterations += 1
        self.speed.observe(self.engine.stats.last_plan, iteration_time_s)
        await self.outbox.publish(result, iteration_time_s)

    def _set_b_xfer(self) -> None:
        """The step's budget, set once from the plan it will run: a fresh remote plan's, else
        (planning locally) the knobs' fixed B_xfer or, with ``auto``, measured link bandwidth x
        the last iteration's time in blocks (unchanged while nothing is measured), as the
        control plane resolves it."""
        kv = self.engine.kv
        remote = self.planner.remote_for(self.engine.stats.num_iterations + 1)
        if remote is not None:
            budget = remote.b_xfer_blocks
        else:
            budget = resolve_b_xfer_blocks(
                self.planner.knobs.b_xfer,
                kv.link_bytes_per_s,
                self._iteration_time_s,
                self.block_bytes,
                kv.b_xfer_blocks,
            )
        kv.set_b_xfer_blocks(budget)

    def _take_requests(self, entries: list[Entry]) -> None:
        """A batch from the request stream, entry by entry (an entry that fails, poisoned or
        hitting a bug, is logged and skipped, never the rest); the handled ones are then
        acknowledged and deleted (:meth:`Intake.ack`)."""
        for entry_id, fields in entries:
            try:
                handled = self._accept(entry_id, fields)
            except Exception as exc:  # a bug on one entry: logged, acknowledged, skipped
                self.num_malformed += 1
                log.exception("request_entry_failed", entry_id=entry_id, error=repr(exc))
                handled = True
            if handled:
                self.intake.done(entry_id)

    def _accept(self, entry_id: bytes, fields: dict[bytes, bytes]) -> bool:
        """Handle one entry; False leaves it pending (a draining worker's next incarnation
        takes it)."""
        if not fields:  # deleted while pending (a gateway moved the request elsewhere)
            return True
        try:
            msg: object = decode(fields.get(b"m", b""), limits=self.limits)
        except ProtocolError as exc:
            self.num_malformed += 1
            log.error("malformed_request_message", entry_id=entry_id, error=str(exc))
            return True
        if isinstance(msg, SubmitRequest):
            if self.draining:
                log.info("request_left_pending_while_draining", request_id=msg.request_id)
                return False
            self.admission.submit(msg)
        elif isinstance(msg, AbortRequest):
            if self.grammars.drop(msg.request_id) or self.engine.abort(msg.request_id):
                log.info("request_aborted", request_id=msg.request_id)
        elif isinstance(msg, AbortReplyStream):
            abort_reply_stream(msg.reply_stream, self.engine, self.replies, self.grammars)
        else:
            log.error("unexpected_message", entry_id=entry_id, type=type(msg).__name__)
        return True

    async def _read_plans(self) -> list[RotationPlan]:
        """The new plans; when one was made with newer knobs than held, those are read too
        (the control plane saw them before this worker's heartbeat did)."""
        response: Any = await self.redis.xread({self.plans_stream: self._last_plan_id}, count=64)
        plans = []
        for entry_id, plan in stream_messages(response, RotationPlan, "malformed_plan_message"):
            self._last_plan_id = entry_id
            if plan is None:
                self.num_malformed += 1
            else:
                plans.append(plan)
        if any(plan.knobs_version > self.planner.knobs_version for plan in plans):
            await self.knobs.read()
        return plans

    def _offer_plans(self, plans: list[RotationPlan]) -> None:
        """Between steps: the knobs read with the plans first, then the plans to the planner
        (it keeps the newest made with its knobs)."""
        if any(plan.knobs_version > self.planner.knobs_version for plan in plans):
            self.knobs.apply()
        for plan in plans:
            self.planner.offer(plan)

    async def _fail_all(self, exc: Exception) -> None:
        """After MAX_FAILED_STEPS engine steps in a row raised, end every request this worker
        owns with an error (clients get a clear 500, not a hang); the engine starts clean."""
        self._num_failed_steps += 1
        if self._num_failed_steps < MAX_FAILED_STEPS:
            return
        log.error("engine_failing_all_requests", error=repr(exc), num_requests=len(self.replies))
        await self.outbox.flush()
        reason = f"engine error: {exc!r}"
        outputs = []
        for request_id in self.replies.request_ids():
            try:
                self.engine.abort(request_id)
            except Exception:  # the failed step may have left it half moved
                log.exception("abort_after_engine_error_failed", request_id=request_id)
            outputs.append(RequestOutput(request_id, [], 0, FinishReason.ERROR, error=reason))
        await self.replies.send(self.redis, outputs)
        self._num_failed_steps = 0

    def _refresh_status(self) -> None:
        """Rebuild the cached status between steps (never while the engine thread runs)."""
        now = time.time()
        if now - self._last_heartbeat_s >= self.settings.heartbeat_interval_s:
            self._last_heartbeat_s = now
            self._status_cache = self._status(now)

    async def _heartbeat(self) -> None:
        """Publish the latest status (with a fresh time; none while a step is stalled), watch
        the gateways' heartbeats; read the knobs when their version changed (applied by
        :meth:`_iterate`, between steps)."""
        await asyncio.sleep(self.settings.heartbeat_interval_s)
        if self.step_watch.stalled():  # gateways then treat this worker as gone
            return
        status = replace(self._status_cache, t_heartbeat_s=time.time(), accepting=not self.draining)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(streams.WORKERS_KEY, self.settings.worker_id, encode(status))
            # Alive for the control plane while idle too: it keeps this worker's lease.
            pipe.zadd(streams.SNAPSHOT_WORKERS_KEY, {self.settings.worker_id: status.t_heartbeat_s})
            await pipe.execute()
        await self.gateways.poll(self.redis)
        await self.knobs.read()

    def _status(self, now: float) -> WorkerStatus:
        mean_iteration_s = self._busy_time_s / max(1, self._busy_iterations)
        self._busy_time_s, self._busy_iterations = 0.0, 0
        return worker_status(
            self.engine,
            self.identity,
            now,
            model_name=self.model_name,
            mean_iteration_s=mean_iteration_s,
            plan_source=self.planner.source,
            policy=self.planner.knobs.policy,
            accepting=not self.draining,
            speed=self.speed,
            lvf_min_residency_s=self.planner.min_residency_s,
        )
