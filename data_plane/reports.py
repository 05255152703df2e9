"""What a worker tells the others about itself: the per-iteration :class:`StateSnapshot` (for
the control plane) and the :class:`WorkerStatus` (for gateways and operators), built from the
engine without touching Redis."""

from __future__ import annotations

from typing import NamedTuple, TypedDict

import numpy as np

from data_plane.engine.engine import Engine, StepResult
from data_plane.kv.manager import PrefixCounters
from data_plane.kv.tiered import KVCacheManager
from data_plane.speed import SpeedMeter
from shared.policy import RequestColumns, columns_from_views
from shared.policy.columns import WAITING_CODE, pick_ids
from shared.protocol import StateSnapshot, WorkerStatus
from shared.protocol.convert import arrays_from_columns, table_from_arrays
from shared.protocol.delta import DeltaEncoder, EncodedRequests


class WorkerIdentity(NamedTuple):
    worker_id: str
    epoch: str
    block_bytes: int


def state_snapshot(
    kv: KVCacheManager,
    identity: WorkerIdentity,
    step: StepResult,
    iteration_time_s: float,
    plan_source: str,
    deltas: DeltaEncoder | None = None,
    base_iteration: int | None = None,
    *,
    lvf_min_residency_s: float | None = None,
) -> StateSnapshot:
    """The snapshot of ``step`` for the wire: its requests as packed columns (the columns the
    step returned, else built from the views) with each request's DRAM blocks already synced,
    the pools' sizes and LVF's residency in force. With ``deltas``, the rows changed since
    ``base_iteration`` when that pays (:class:`~shared.protocol.delta.DeltaEncoder`)."""
    snapshot, columns = step.snapshot, step.columns
    if columns is None:
        requests = snapshot.requests
        columns = requests if isinstance(requests, RequestColumns) else columns_from_views(requests)
    synced = np.zeros(len(columns), np.int64)  # a waiting request holds no blocks
    holding = np.flatnonzero(columns.states != WAITING_CODE)
    synced[holding] = kv.num_synced_blocks(pick_ids(columns.request_ids, holding))
    stats = kv.stats()
    arrays = arrays_from_columns(columns, synced)
    if deltas is None:
        encoded = EncodedRequests(table_from_arrays(arrays), None)
    else:
        encoded = deltas.encode(snapshot.iteration, arrays, base_iteration)
    return StateSnapshot(
        worker_id=identity.worker_id,
        epoch=identity.epoch,
        iteration=snapshot.iteration,
        t_now_s=snapshot.t_now_s,
        requests=encoded.requests,
        delta=encoded.delta,
        num_free_hbm_blocks=snapshot.num_free_hbm_blocks,
        num_free_dram_blocks=snapshot.num_free_dram_blocks,
        num_hbm_blocks=stats.num_hbm_blocks,
        num_dram_blocks=stats.num_dram_blocks,
        block_size=snapshot.block_size,
        block_bytes=identity.block_bytes,
        max_num_batched_tokens=snapshot.max_num_batched_tokens,
        max_num_seqs=snapshot.max_num_seqs,
        b_xfer_blocks=kv.b_xfer_blocks,
        b_xfer_queued_blocks=kv.num_queued_rotation_blocks,
        iteration_time_s=iteration_time_s,
        link_bytes_per_s=stats.link_bytes_per_s,  # measured by the transfer engine; 0 until then
        plan_source=plan_source,
        lvf_min_residency_s=lvf_min_residency_s,
        tenant_service=list(snapshot.tenant_service),
        long_prefill_token_threshold=snapshot.long_prefill_token_threshold,
    )


def _prefix_counts(prefix: PrefixCounters) -> dict[str, int]:
    """vLLM's prefix-cache queries and hits, in tokens, hits per tier."""
    return {
        "num_prefix_queried_tokens": prefix.num_queried_tokens,
        "num_prefix_hbm_hit_tokens": prefix.num_hbm_hit_tokens,
        "num_prefix_dram_hit_tokens": prefix.num_dram_hit_tokens,
    }


class _SpeedFields(TypedDict):
    prefill_tokens_per_s: float
    decode_step_s: float
    decode_base_s: float
    decode_s_per_request: float


def _speed(speed: SpeedMeter) -> _SpeedFields:
    """The measured prefill rate, decode step and the decode step's fit to its batch size."""
    decode_base_s, decode_s_per_request = speed.decode_fit.coefficients()
    return {
        "prefill_tokens_per_s": speed.prefill_tokens_per_s,
        "decode_step_s": speed.decode_step_s,
        "decode_base_s": decode_base_s,
        "decode_s_per_request": decode_s_per_request,
    }


def worker_status(
    engine: Engine,
    identity: WorkerIdentity,
    now: float,
    *,
    model_name: str,
    mean_iteration_s: float,
    plan_source: str,
    policy: str,
    accepting: bool,
    lvf_min_residency_s: float | None = None,
    speed: SpeedMeter | None = None,
) -> WorkerStatus:
    """The worker's health and load: queues, KV usage per tier, plan source, counters, and
    its measured speed (none measured: without ``speed``)."""
    speed = SpeedMeter() if speed is None else speed
    kv = engine.kv
    stats = kv.stats()
    block_bytes = identity.block_bytes
    return WorkerStatus(
        worker_id=identity.worker_id,
        epoch=identity.epoch,
        t_heartbeat_s=now,
        model_name=model_name,
        max_model_len=engine.max_model_len,
        num_running=len(engine.running),
        num_waiting=len(engine.waiting),
        num_rotary=len(engine.rotary),
        num_waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in engine.waiting),
        num_hbm_blocks=stats.num_hbm_blocks,
        num_free_hbm_blocks=stats.num_free_hbm_blocks,
        num_dram_blocks=stats.num_dram_blocks,
        num_free_dram_blocks=stats.num_free_dram_blocks,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        iteration_time_s=mean_iteration_s,
        plan_source=plan_source,
        policy=policy,
        accepting=accepting,
        lvf_min_residency_s=lvf_min_residency_s,
        num_preemptions=engine.stats.num_preemptions,
        num_rotations_out=engine.stats.num_rotations_out,
        num_rotations_in=engine.stats.num_rotations_in,
        bytes_h2d=stats.num_blocks_loaded * block_bytes,
        bytes_d2h=stats.num_blocks_stored * block_bytes,
        num_cached_hbm_blocks=stats.num_cached_hbm_blocks,
        num_cached_dram_blocks=stats.num_cached_dram_blocks,
        **_prefix_counts(stats.prefix),
        **_speed(speed),
        b_xfer_blocks=kv.b_xfer_blocks,
        link_bytes_per_s=stats.link_bytes_per_s,
    )
