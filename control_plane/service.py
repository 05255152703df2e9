"""`superinfer control-plane`: plan every worker's next iteration from its latest snapshot,
under LVF (the peers' policies, vllm and the rest, are planned by each worker, as their own
engines do).

Each worker publishes its snapshots on its own stream; only the newest matters (older ones are
skipped, so a slow control plane never falls behind). Plans go to each worker's plan stream,
each with the knobs version it was made with. The knobs live in a Redis hash with a version
(seeded where Redis has none by the first service to start: a worker's flags or
``SUPERINFER_KNOBS``) and are reloaded when the version changes; until Redis holds knobs
nothing is planned (the workers plan locally). The last knobs and SLO classes it saw are
written back when Redis loses them (:mod:`control_plane.keeper`). LVF's adaptive residency is
each worker's: its value comes in the snapshot. The service keeps no state that a restart
would lose: it resumes from the next snapshot (a delta against a table it no longer holds is
skipped until the worker sends a whole one).

Several replicas share the workers (:mod:`control_plane.lease`): each finds the workers in the
registry (:mod:`control_plane.snapshots`), reads and plans only those whose lease it holds, and
publishes through the fence, so a worker gets at most one plan per iteration.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from control_plane.keeper import ConfigKeeper
from control_plane.lease import PUBLISHED, Leases
from control_plane.settings import ControlPlaneSettings
from control_plane.snapshots import SnapshotReader, WorkerDirectory, WorkerSnapshot
from shared import streams
from shared.b_xfer import resolve_b_xfer_blocks
from shared.knobs import read_knobs
from shared.policy import (
    ColumnarSnapshot,
    Knobs,
    RequestColumns,
    plan_handles,
    planned_remotely,
)
from shared.policy.adaptive import residency_knobs
from shared.protocol import RotationPlan, StateSnapshot, encode
from shared.protocol.convert import columns_from_table
from shared.runtime import (
    collect_due_garbage,
    garbage_collected_between_iterations,
    loop_with_backoff,
)

log = structlog.get_logger(__name__)
# Announcements trigger a lease round at most this often (many stalled workers announcing
# must not turn every read into a round; the renewal loop's rounds come on top).
JOIN_ROUND_MIN_S = 0.1


def to_policy_snapshot(
    msg: StateSnapshot, b_xfer_blocks: int, columns: RequestColumns | None = None
) -> ColumnarSnapshot:
    """The policy's input: ``columns`` (the whole table, rebuilt when ``msg`` is a delta),
    else straight from the message's packed columns (no per-request object: LVF plans on the
    columns; the view-walking policies get views made for them)."""
    if columns is None:
        if msg.delta is not None:
            raise ValueError("a delta snapshot needs its rebuilt columns")
        columns = columns_from_table(msg.requests)
    return ColumnarSnapshot(
        t_now_s=msg.t_now_s,
        requests=columns,
        num_free_hbm_blocks=msg.num_free_hbm_blocks,
        num_free_dram_blocks=msg.num_free_dram_blocks,
        block_size=msg.block_size,
        max_num_batched_tokens=msg.max_num_batched_tokens,
        max_num_seqs=msg.max_num_seqs,
        b_xfer_blocks=b_xfer_blocks,
        iteration=msg.iteration,
        tenant_service=tuple(msg.tenant_service),
        long_prefill_token_threshold=msg.long_prefill_token_threshold,
    )


def resolve_b_xfer(knobs: Knobs, msg: StateSnapshot) -> int:
    """The worker's budget: a fixed one, or ``auto``: its measured link bandwidth x its
    iteration time, in blocks (its budget in force while no bandwidth has been measured)."""
    return resolve_b_xfer_blocks(
        knobs.b_xfer, msg.link_bytes_per_s, msg.iteration_time_s, msg.block_bytes, msg.b_xfer_blocks
    )


def plan_for(
    msg: StateSnapshot,
    knobs: Knobs,
    knobs_version: int,
    columns: RequestColumns | None = None,
) -> RotationPlan:
    """The plan for one worker's snapshot (``columns``: its whole table, see
    :func:`to_policy_snapshot`), made with ``knobs`` (version ``knobs_version``) and, for LVF
    with ``adaptive_residency``, the residency the worker's controller holds. The plan carries
    the worker's budget; the policy plans with what its queued copies leave of it."""
    b_xfer = resolve_b_xfer(knobs, msg)
    available = max(0, b_xfer - msg.b_xfer_queued_blocks)  # as the worker's own LVF plans
    snapshot = to_policy_snapshot(msg, available, columns)
    knobs = residency_knobs(knobs, msg.lvf_min_residency_s)
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
        self.knobs = Knobs()  # a placeholder: nothing is planned before knobs are loaded
        self.knobs_version = 0  # of the knobs loaded from Redis; 0: none yet
        self.num_plans = 0
        self.num_fenced = 0  # plans the fence refused (lease lost, iteration already planned)
        self._knobs_checked_s = 0.0
        self.keeper = ConfigKeeper()
        self.leases = Leases(redis, settings.replica_id, settings.lease_ttl_ms)
        self.directory = WorkerDirectory(settings.worker_release_s)
        self.reader = SnapshotReader(redis, settings.read_block_ms)
        self._lease_lock = asyncio.Lock()  # rounds run from the renewal loop and on a join
        self._join_round_s = -JOIN_ROUND_MIN_S
        self._join_round_wanted = False
        self.num_unplannable = 0  # snapshots that decoded but could not be planned

    @property
    def num_malformed(self) -> int:
        """Snapshots dropped: undecodable (counted by the reader) or unplannable (here)."""
        return self.reader.num_malformed + self.num_unplannable

    async def run(self, stop: asyncio.Event) -> None:
        """Plan until ``stop``, renewing the leases beside; a clean stop releases them (a
        cancelled run, like a killed process, leaves them to expire)."""
        log.info("control_plane_started", replica_id=self.settings.replica_id)
        renewing = asyncio.create_task(loop_with_backoff(self._renew_leases, stop))
        try:
            with garbage_collected_between_iterations():
                await loop_with_backoff(self._iterate, stop)
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
        try:
            await self.leases.release_all()
        except RedisError as exc:  # they expire on their own
            log.warning("leases_not_released", error=str(exc))
        log.info("control_plane_stopped", num_plans=self.num_plans, num_fenced=self.num_fenced)

    async def _renew_leases(self) -> None:
        await self._lease_round()
        await asyncio.sleep(self.settings.lease_renew_s)

    async def _lease_round(self) -> None:
        """Find the workers, renew and rebalance the leases towards a fair share of them."""
        async with self._lease_lock:
            workers = await self.directory.refresh(self.redis)
            await self.leases.round(workers)
            self.reader.keep_only(self.leases.owned)

    async def _iterate(self) -> None:
        await self._heartbeat_and_knobs()
        snapshots, joined = await self.reader.read(set(self.leases.owned))
        if joined:  # a new or unplanned worker: lease it now, not at the next renewal
            self.directory.joined(joined)
            self._join_round_wanted = True
        if self._join_round_wanted and time.monotonic() - self._join_round_s >= JOIN_ROUND_MIN_S:
            self._join_round_wanted = False
            self._join_round_s = time.monotonic()
            await self._lease_round()
        # never with knobs Redis does not hold; the peers' policies are planned by the workers
        if snapshots and self.knobs_version > 0 and planned_remotely(self.knobs):
            await self._publish_plans(snapshots)
        collect_due_garbage()  # the plans are out: off the round trip's critical path

    async def _publish_plans(self, snapshots: list[WorkerSnapshot]) -> None:
        """One plan per snapshot, all published through the fence in one round trip."""
        plans: list[tuple[str, str, int, bytes]] = []
        for snapshot in snapshots:
            msg = snapshot.msg
            try:
                plan = plan_for(msg, self.knobs, self.knobs_version, snapshot.columns)
            except (ValueError, KeyError, ArithmeticError) as exc:  # e.g. a huge count
                self.num_unplannable += 1
                log.error("unplannable_snapshot", worker_id=msg.worker_id, error=str(exc))
                continue
            plans.append((msg.worker_id, msg.epoch, msg.iteration, encode(plan)))
        results = await self.leases.publish(plans) if plans else []
        published = sum(1 for r in results if r == PUBLISHED)
        self.num_plans += published
        self.num_fenced += len(results) - published

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

    async def _reload_knobs(self) -> None:
        """The knobs in Redis when their version changed; none there (version 0: not written
        yet, or lost until the keeper restores them) changes nothing."""
        version = int(await self.redis.hget(streams.KNOBS_KEY, "version") or 0)
        if version in (0, self.knobs_version):
            return
        try:
            knobs, version = await read_knobs(self.redis)
        except ValueError as exc:  # written around the validating path: keep the old knobs
            log.error("invalid_knobs_in_redis", error=str(exc))
            return
        if version > 0:  # not lost in between
            self.knobs, self.knobs_version = knobs, version
            log.info("knobs_loaded", version=version, policy=knobs.policy)
