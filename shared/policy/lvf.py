"""Largest-VLT-First (SUPERINFER.md §4), once per engine iteration, as a pure function."""

from __future__ import annotations

from shared.policy.common import (
    demand_blocks,
    growth_blocks,
    pack_schedule,
    split_by_state,
)
from shared.policy.types import Knobs, Plan, RequestState, RequestView, Snapshot
from shared.policy.vlt import vlt


def lvf(snapshot: Snapshot, knobs: Knobs) -> Plan:
    """Rank waiting, running and rotary requests in one VLT order; admit/resume from the head
    within B_HBM + B_xfer, rotate out from the tail while VLT < 0 and B_swap > 0.

    B_HBM is the free HBM left after the running requests' next-chunk growth. Without room in
    DRAM, a rotate-out victim is preempted by recompute instead.
    """
    running, waiting, rotary = split_by_state(snapshot.requests)
    bs = snapshot.block_size
    b_hbm = snapshot.num_free_hbm_blocks - sum(growth_blocks(v, snapshot) for v in running)
    plan = Plan()
    if b_hbm >= sum(demand_blocks(v, bs) for v in waiting + rotary):
        return _fcfs(snapshot, running, waiting, rotary, plan)
    t_now = snapshot.t_now_s
    scores = {v.request_id: vlt(v, t_now, knobs) for v in snapshot.requests}
    ranked = sorted(
        snapshot.requests, key=lambda v: (-scores[v.request_id], v.t_arr_s, v.arrival_seq)
    )
    b_xfer = snapshot.b_xfer_blocks
    b_left = b_hbm + b_xfer
    for view in ranked:
        if view.state is RequestState.RUNNING or scores[view.request_id] < 0:
            continue
        blk = demand_blocks(view, bs)
        if blk <= b_left:
            (plan.resume_ids if view.state is RequestState.ROTARY else plan.admit_ids).append(
                view.request_id
            )
            b_left -= blk
    b_swap = b_xfer - b_left
    _rotate_out_tail(ranked, scores, b_swap, snapshot, plan)
    chosen = set(plan.admit_ids) | set(plan.resume_ids)
    leaving = set(plan.rotate_out_ids) | set(plan.preempt_ids)
    keep = [v for v in running if v.request_id not in leaving]
    joining = [v for v in ranked if v.request_id in chosen]
    plan.schedule = pack_schedule(keep + _as_running(joining), snapshot, max(0, b_hbm))
    return plan


def _rotate_out_tail(
    ranked: list[RequestView],
    scores: dict[str, float],
    b_swap: int,
    snapshot: Snapshot,
    plan: Plan,
) -> None:
    free_dram = snapshot.num_free_dram_blocks
    for view in reversed(ranked):
        if b_swap <= 0 or scores[view.request_id] >= 0:
            break
        if view.state is not RequestState.RUNNING:
            continue
        dram_needed = max(0, view.num_blocks_hbm - view.num_blocks_dram)
        if dram_needed <= free_dram:
            plan.rotate_out_ids.append(view.request_id)
            free_dram -= dram_needed
        else:
            plan.preempt_ids.append(view.request_id)
        b_swap -= view.num_blocks_hbm


def _as_running(views: list[RequestView]) -> list[RequestView]:
    """Views of newly chosen requests as they will run: admitted ones are resident at once,
    resumed ones only after their H2D copy."""
    from dataclasses import replace

    return [
        replace(v, state=RequestState.RUNNING, resident=v.state is RequestState.WAITING)
        for v in views
    ]


def _fcfs(
    snapshot: Snapshot,
    running: list[RequestView],
    waiting: list[RequestView],
    rotary: list[RequestView],
    plan: Plan,
) -> Plan:
    """Enough HBM for every waiting and rotary request: no rotation, FCFS admission."""
    plan.fcfs_fallback = True
    room = snapshot.max_num_seqs - len(running)
    for view in sorted(rotary + waiting, key=lambda v: (v.t_arr_s, v.arrival_seq))[: max(0, room)]:
        (plan.resume_ids if view.state is RequestState.ROTARY else plan.admit_ids).append(
            view.request_id
        )
    chosen = set(plan.admit_ids) | set(plan.resume_ids)
    joining = [v for v in rotary + waiting if v.request_id in chosen]
    joining.sort(key=lambda v: (v.t_arr_s, v.arrival_seq))
    b_hbm = snapshot.num_free_hbm_blocks
    plan.schedule = pack_schedule(running + _as_running(joining), snapshot, b_hbm)
    return plan
