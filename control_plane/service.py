"""`superinfer control-plane`: plan every worker's next iteration from its latest snapshot.

Snapshots arrive on one stream; only the newest per worker matters (older ones are skipped, so
a slow control plane never falls behind). Plans go to each worker's plan stream. The knobs live
in a Redis hash with a version and are reloaded when the version changes; the last knobs and SLO
classes it saw are written back when Redis loses them (:mod:`control_plane.keeper`). The service
keeps no state that a restart would lose: it resumes from the next snapshot.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
from redis.asyncio import Redis

from control_plane.keeper import ConfigKeeper
from control_plane.settings import ControlPlaneSettings
from shared import streams
from shared.b_xfer import resolve_b_xfer_blocks
from shared.knobs import read_knobs
from shared.policy import ColumnarSnapshot, Knobs, plan_handles
from shared.policy.adaptive import ResidencyController, controlled_knobs
from shared.protocol import RotationPlan, StateSnapshot, encode
from shared.protocol.convert import columns_from_table, stream_messages
from shared.runtime import (
    collect_due_garbage,
    garbage_collected_between_iterations,
    loop_with_backoff,
)

log = structlog.get_logger(__name__)


def to_policy_snapshot(msg: StateSnapshot, b_xfer_blocks: int) -> ColumnarSnapshot:
    """The policy's input, straight from the message's packed columns (no per-request
    object: LVF plans on the columns; the view-walking policies get views made for them)."""
    return ColumnarSnapshot(
        t_now_s=msg.t_now_s,
        requests=columns_from_table(msg.requests),
        num_free_hbm_blocks=msg.num_free_hbm_blocks,
        num_free_dram_blocks=msg.num_free_dram_blocks,
        block_size=msg.block_size,
        max_num_batched_tokens=msg.max_num_batched_tokens,
        max_num_seqs=msg.max_num_seqs,
        b_xfer_blocks=b_xfer_blocks,
        iteration=msg.iteration,
    )


def resolve_b_xfer(knobs: Knobs, msg: StateSnapshot) -> int:
    """A fixed budget, or ``auto``: the worker's measured link bandwidth x its iteration time,
    in blocks (its current budget while no bandwidth has been measured)."""
    return resolve_b_xfer_blocks(
        knobs.b_xfer, msg.link_bytes_per_s, msg.iteration_time_s, msg.block_bytes, msg.b_xfer_blocks
    )


def plan_for(
    msg: StateSnapshot,
    knobs: Knobs,
    knobs_version: int,
    residency: ResidencyController | None = None,
) -> RotationPlan:
    """The plan for one worker's snapshot; ``residency``: that worker's adaptive-residency
    controller (LVF with ``adaptive_residency`` plans with its value)."""
    b_xfer = resolve_b_xfer(knobs, msg)
    snapshot = to_policy_snapshot(msg, b_xfer)
    if residency is not None:
        _, knobs = controlled_knobs(snapshot, knobs, residency)
    moves = plan_handles(snapshot, knobs)
    return RotationPlan(
        worker_id=msg.worker_id,
        epoch=msg.epoch,
        snapshot_iteration=msg.iteration,
        knobs_version=knobs_version,
        policy=knobs.policy,
        admit_seqs=moves.admit,
        resume_seqs=moves.resume,
        rotate_out_seqs=moves.rotate_out,
        preempt_seqs=moves.preempt,
        fcfs_fallback=moves.fcfs_fallback,
        t_planned_s=time.time(),
        b_xfer_blocks=b_xfer,
    )


class ControlPlane:
    def __init__(self, settings: ControlPlaneSettings, redis: Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.knobs = Knobs()
        self.knobs_version = -1
        self.num_plans = 0
        self.num_malformed = 0
        self._last_id: Any = "$"
        self._knobs_checked_s = 0.0
        self.keeper = ConfigKeeper()
        # Per worker: (its epoch, its adaptive-residency controller); restarted with the knobs.
        self.residency: dict[str, tuple[str, ResidencyController]] = {}

    async def run(self, stop: asyncio.Event) -> None:
        log.info("control_plane_started")
        with garbage_collected_between_iterations():
            await loop_with_backoff(self._iterate, stop)
        log.info("control_plane_stopped", num_plans=self.num_plans)

    async def _iterate(self) -> None:
        if self.knobs_version < 0:
            await self._reload_knobs(force=True)
        if self._last_id == "$":  # start after the newest snapshot, never miss a later one
            last: Any = await self.redis.xrevrange(streams.SNAPSHOTS_STREAM, count=1)
            self._last_id = last[0][0] if last else "0-0"
        await self._heartbeat_and_knobs()
        response: Any = await self.redis.xread(
            {streams.SNAPSHOTS_STREAM: self._last_id}, count=512, block=self.settings.read_block_ms
        )
        newest: dict[str, StateSnapshot] = {}
        for entry_id, msg in stream_messages(response, StateSnapshot, "malformed_snapshot"):
            self._last_id = entry_id
            if msg is None:
                self.num_malformed += 1
            else:
                newest[msg.worker_id] = msg
        if newest:
            await self._publish_plans(list(newest.values()))
        collect_due_garbage()  # the plans are out: off the round trip's critical path

    async def _publish_plans(self, snapshots: list[StateSnapshot]) -> None:
        """One plan per snapshot, each to its worker's plan stream with its own XADD (sent
        together; with one worker, the common case, that is a single command)."""
        writes = []
        for msg in snapshots:
            try:
                plan = plan_for(msg, self.knobs, self.knobs_version, self._residency_of(msg))
            except (ValueError, KeyError, ArithmeticError) as exc:  # e.g. a huge count
                self.num_malformed += 1
                log.error("unplannable_snapshot", worker_id=msg.worker_id, error=str(exc))
                continue
            stream = streams.worker_plans_stream(msg.worker_id)
            data = encode(plan)
            writes.append(
                self.redis.xadd(stream, {"m": data}, maxlen=streams.MAXLEN_PLANS, approximate=True)
            )
            self.num_plans += 1
        await asyncio.gather(*writes)

    def _residency_of(self, msg: StateSnapshot) -> ResidencyController:
        """The worker's controller; a new incarnation (epoch) starts a new one."""
        epoch, controller = self.residency.get(msg.worker_id, ("", None))
        if controller is None or epoch != msg.epoch:
            controller = ResidencyController(value_s=self.knobs.min_residency_s)
            self.residency[msg.worker_id] = (msg.epoch, controller)
        return controller

    async def _heartbeat_and_knobs(self) -> None:
        now = time.monotonic()
        if now - self._knobs_checked_s < self.settings.knobs_poll_s:
            return
        self._knobs_checked_s = now
        await self.redis.set(
            streams.CONTROL_PLANE_HEARTBEAT_KEY, str(time.time()), ex=self.settings.heartbeat_ttl_s
        )
        await self.keeper.check(self.redis)
        await self._reload_knobs()

    async def _reload_knobs(self, force: bool = False) -> None:
        version = int(await self.redis.hget(streams.KNOBS_KEY, "version") or 0)
        if version == self.knobs_version and not force:
            return
        try:
            self.knobs, self.knobs_version = await read_knobs(self.redis)
        except ValueError as exc:  # written around the validating path: keep the old knobs
            log.error("invalid_knobs_in_redis", error=str(exc))
            return
        self.residency.clear()  # an operator's new residency is every controller's start
        log.info("knobs_loaded", version=self.knobs_version, policy=self.knobs.policy)
