"""Each engine step's snapshot and token outputs on their way to Redis while the next step runs.

At most one send is in flight, so they leave in step order; a send's Redis error surfaces one
step later, when the next publish (or :meth:`Outbox.flush`) awaits it.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from redis.asyncio import Redis

from data_plane.engine.engine import StepResult
from data_plane.engine.request import RequestOutput
from data_plane.kv.tiered import KVCacheManager
from data_plane.planner import HybridPlanner
from data_plane.replies import Replies
from data_plane.reports import WorkerIdentity, state_snapshot
from shared.bus import queue_snapshot, should_announce
from shared.protocol import encode
from shared.protocol.delta import DeltaEncoder

log = structlog.get_logger(__name__)
# A step with nothing to decide (HybridPlanner.quiet) sends its snapshot at most this often
# (the control plane's view of it stays that fresh; the heartbeat keeps its lease).
QUIET_SNAPSHOT_S = 1.0


class Outbox:
    def __init__(
        self,
        redis: Redis,
        replies: Replies,
        planner: HybridPlanner,
        kv: KVCacheManager,
        identity: WorkerIdentity,
        *,
        snapshot_deltas: bool,
    ) -> None:
        self.redis = redis
        self.replies = replies
        self.planner = planner
        self.kv = kv
        self.identity = identity
        self.deltas = DeltaEncoder() if snapshot_deltas else None
        self._announced_s: float | None = None  # when a snapshot last announced this worker
        self._snapshot_sent_s = -QUIET_SNAPSHOT_S  # monotonic time a snapshot was last encoded
        self._send_task: asyncio.Task[None] | None = None

    async def publish(self, result: StepResult, iteration_time_s: float) -> None:
        """Encode the step's snapshot now (it reads the engine, which the next step changes)
        and send it and the step's outputs while the next step runs: the previous send is
        awaited first, so a Redis error surfaces here, one step later. A quiet step's snapshot
        goes only every QUIET_SNAPSHOT_S (at one stream planning each one cost the control
        plane ~1 ms of CPU per token, taken from the step on a two-core host)."""
        msg_bytes = None
        now_s = time.monotonic()
        iteration = result.snapshot.iteration
        if not self.planner.quiet(iteration) or now_s - self._snapshot_sent_s >= QUIET_SNAPSHOT_S:
            msg_bytes = self.snapshot_bytes(result, iteration_time_s)
            self._snapshot_sent_s = now_s
        try:  # the previous send's error is raised here, after this step's send is started:
            await self.flush()  # never before it (the step's tokens were lost)
        finally:
            self._send_task = asyncio.create_task(self._send(result.outputs, msg_bytes))

    async def flush(self) -> None:
        """Wait for the send in flight, if any (its Redis error is raised here)."""
        task, self._send_task = self._send_task, None
        if task is not None:
            await task

    async def _send(self, outputs: list[RequestOutput], msg_bytes: bytes | None) -> None:
        """The snapshot first, so the control plane plans while the tokens go out; then the
        token outputs and lifecycle updates (:meth:`Replies.send`), whatever happened to the
        snapshot: outputs whose write fails are kept and sent again with the next write."""
        try:
            if msg_bytes is not None:
                now = time.time()
                local = self.planner.source == "local"
                announce = should_announce(self._announced_s, local, now)
                async with self.redis.pipeline(transaction=False) as pipe:
                    queue_snapshot(pipe, self.identity.worker_id, msg_bytes, now, announce)
                    await pipe.execute()
                self._announced_s = now if announce else self._announced_s
        finally:
            await self.replies.send(self.redis, outputs)

    def snapshot_bytes(self, result: StepResult, iteration_time_s: float) -> bytes | None:
        """The step's encoded snapshot (a delta against the newest fresh plan's table when
        that pays), or None (logged) when a value cannot travel: the worker then plans locally,
        it does not stop."""
        iteration = result.snapshot.iteration
        try:
            message = state_snapshot(
                self.kv,
                self.identity,
                result,
                iteration_time_s,
                self.planner.source,
                self.deltas,
                self.planner.delta_base(iteration),
                lvf_min_residency_s=self.planner.min_residency_s,
            )
            return encode(message)
        except ValueError as exc:
            log.error("snapshot_not_published", iteration=iteration, error=str(exc))
            return None
