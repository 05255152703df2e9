"""Engine snapshot -> wire message (ids and counts only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.policy import Snapshot
from shared.protocol import RequestRow, StateSnapshot

if TYPE_CHECKING:
    from data_plane.service import Worker


def snapshot_message(worker: Worker, snapshot: Snapshot, iteration_time_s: float) -> StateSnapshot:
    kv = worker.engine.kv
    tables = kv.tables
    rows = []
    for v in snapshot.requests:
        table = tables.get(v.request_id)
        rows.append(
            RequestRow(
                v.request_id,
                v.state.value,
                v.t_arr_s,
                v.t_run_s,
                v.t_last_s,
                v.num_tokens,
                v.num_computed_tokens,
                v.num_blocks_hbm,
                v.num_blocks_dram,
                table.num_synced if table else 0,
                v.priority,
                v.slo_ttft_s,
                v.slo_tbt_s,
                v.resident,
                v.arrival_seq,
            )
        )
    dram = getattr(kv, "dram", None)
    return StateSnapshot(
        worker_id=worker.settings.worker_id,
        epoch=worker.epoch,
        iteration=snapshot.iteration,
        t_now_s=snapshot.t_now_s,
        requests=rows,
        num_free_hbm_blocks=snapshot.num_free_hbm_blocks,
        num_free_dram_blocks=snapshot.num_free_dram_blocks,
        num_hbm_blocks=kv.hbm.num_blocks,
        num_dram_blocks=dram.num_blocks if dram is not None else 0,
        block_size=snapshot.block_size,
        block_bytes=worker.block_bytes,
        max_num_batched_tokens=snapshot.max_num_batched_tokens,
        max_num_seqs=snapshot.max_num_seqs,
        b_xfer_blocks=snapshot.b_xfer_blocks,
        iteration_time_s=iteration_time_s,
        link_bytes_per_s=0.0,
        plan_source=worker.planner.source,
    )
