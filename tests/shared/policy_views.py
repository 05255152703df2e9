"""Hand-built requests and snapshots for the policy tests (t_now = 10 s, 16-token blocks)."""

from __future__ import annotations

from shared.policy import Knobs, Plan, RequestState, RequestView, Snapshot
from shared.policy.types import ScheduledChunk

BS = 16
T_NOW = 10.0
LVF = Knobs(policy="lvf")


def running(
    rid: str,
    *,
    t_run: float,
    blocks: int = 2,
    pending: int = 1,
    dram: int = 0,
    resident: bool = True,
    seq: int = 0,
    t_last: float | None = T_NOW,
) -> RequestView:
    """A running request holding ``blocks`` blocks, computed up to mid-block (a decode needs
    no new block when ``pending`` is 1), that generated a token at ``t_last``."""
    computed = blocks * BS - BS // 2
    return RequestView(
        rid,
        RequestState.RUNNING,
        t_arr_s=t_run - 1.0,
        num_tokens=computed + pending,
        num_computed_tokens=computed,
        num_blocks_hbm=blocks,
        num_blocks_dram=dram,
        t_run_s=t_run,
        t_last_s=t_last,
        arrival_seq=seq,
        resident=resident,
    )


def waiting(
    rid: str, *, t_arr: float, blocks: int = 2, seq: int = 0, slo_ttft: float | None = None
) -> RequestView:
    return RequestView(
        rid,
        RequestState.WAITING,
        t_arr_s=t_arr,
        num_tokens=blocks * BS,
        arrival_seq=seq,
        slo_ttft_s=slo_ttft,
    )


def rotary(
    rid: str, *, t_last: float, blocks: int = 2, seq: int = 0, slo_tbt: float | None = None
) -> RequestView:
    """A rotary request whose KV (``blocks`` blocks) sits in DRAM; it needs ``blocks`` blocks
    back in HBM to run its next decode."""
    return RequestView(
        rid,
        RequestState.ROTARY,
        t_arr_s=t_last - 5.0,
        num_tokens=blocks * BS,
        num_computed_tokens=blocks * BS - 1,
        num_blocks_dram=blocks,
        t_run_s=t_last - 4.0,
        t_last_s=t_last,
        arrival_seq=seq,
        slo_tbt_s=slo_tbt,
    )


def snap(
    *views: RequestView,
    free: int,
    xfer: int = 0,
    dram: int = 1000,
    seqs: int = 64,
    budget: int = 8192,
    t_now: float = T_NOW,
) -> Snapshot:
    return Snapshot(
        t_now_s=t_now,
        requests=tuple(views),
        num_free_hbm_blocks=free,
        num_free_dram_blocks=dram,
        block_size=BS,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        b_xfer_blocks=xfer,
    )


def ids(chunks: list[ScheduledChunk]) -> list[str]:
    return [chunk.request_id for chunk in chunks]


def check_plan(snapshot: Snapshot, plan: Plan) -> None:
    """What every LVF plan must satisfy, whatever the scenario."""
    states = {v.request_id: v for v in snapshot.requests}
    chosen = plan.admit_ids + plan.resume_ids
    leaving = plan.rotate_out_ids + plan.preempt_ids
    assert not set(chosen) & set(leaving)
    assert len(set(chosen + leaving)) == len(chosen + leaving)
    staying = sum(v.state is RequestState.RUNNING for v in snapshot.requests) - len(leaving)
    assert staying + len(chosen) <= snapshot.max_num_seqs
    assert plan.num_scheduled_tokens <= snapshot.max_num_batched_tokens
    for chunk in plan.schedule:
        view = states[chunk.request_id]
        assert chunk.request_id not in plan.resume_ids and chunk.request_id not in leaving
        assert view.resident and 1 <= chunk.num_tokens <= view.num_tokens - view.num_computed_tokens


# ---- VLT (§3) ------------------------------------------------------------------------------
