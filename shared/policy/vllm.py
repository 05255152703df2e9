"""vLLM V1's scheduler decisions (SUPERINFER.md §7), as a pure function over a snapshot.

FCFS (or priority: lower value first, arrival breaks ties); running requests first (decodes,
then prefill chunks) within ``max_num_batched_tokens``; when a running request cannot get a
block, the last running request (the worst priority under ``priority``) is preempted by
recompute; a step that preempted admits nobody new. Waiting admission stops at the first
request that does not fit (head-of-line blocking, as in vLLM). Rotary requests (left over when
an operator switches from a rotating policy) are resumed before any admission.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.policy.common import (
    blocks_for,
    demand_blocks,
    is_decode,
    num_pending_tokens,
    split_by_state,
)
from shared.policy.types import Plan, RequestView, ScheduledChunk, Snapshot


OrderKey = Callable[[RequestView], tuple[float, float, int]]


def vllm(
    snapshot: Snapshot,
    order_key: OrderKey | None = None,
    swap: bool = False,
) -> Plan:
    """One scheduling step in vLLM's style.

    ``order_key`` None is FCFS (V1 default); otherwise waiting requests are taken and victims
    chosen by that key (lowest first / highest evicted), e.g. :func:`priority_key`.
    ``swap`` is vLLM V0's swap preemption: victims rotate out to DRAM (recompute when DRAM is
    full) and no new request is admitted while any request is still swapped out.
    """
    running, waiting, rotary = split_by_state(snapshot.requests)
    if order_key is not None:
        waiting.sort(key=order_key)
    plan = Plan()
    free = _schedule_running(snapshot, running, plan, order_key)
    if swap:
        _swap_instead_of_recompute(snapshot, plan)
    if plan.preempt_ids or plan.rotate_out_ids:
        return plan
    free = _resume_rotary(snapshot, rotary, free, plan)
    if swap and len(plan.resume_ids) < len(rotary):
        return plan
    _admit_waiting(snapshot, waiting, free, plan)
    return plan


def priority_key(view: RequestView) -> tuple[float, float, int]:
    return (view.priority, view.t_arr_s, view.arrival_seq)


def _pick_victim(candidates: list[RequestView], order_key: OrderKey | None) -> RequestView:
    if order_key is not None:
        return max(candidates, key=order_key)
    return candidates[-1]


def _swap_instead_of_recompute(snapshot: Snapshot, plan: Plan) -> None:
    views = {v.request_id: v for v in snapshot.requests}
    free_dram = snapshot.num_free_dram_blocks
    recompute: list[str] = []
    for request_id in plan.preempt_ids:
        view = views[request_id]
        dram_needed = max(0, view.num_blocks_hbm - view.num_blocks_dram)
        if view.num_computed_tokens > 0 and dram_needed <= free_dram:
            plan.rotate_out_ids.append(request_id)
            free_dram -= dram_needed
        else:
            recompute.append(request_id)
    plan.preempt_ids = recompute


def _schedule_running(
    snapshot: Snapshot, running: list[RequestView], plan: Plan, order_key: OrderKey | None
) -> int:
    """Decodes, then running prefill chunks; preempt on block shortage. Returns free blocks."""
    free = snapshot.num_free_hbm_blocks
    budget = snapshot.max_num_batched_tokens
    queue = [v for v in running if is_decode(v)] + [v for v in running if not is_decode(v)]
    alive = list(queue)
    grown: dict[str, tuple[int, int]] = {}  # request id -> (new blocks, tokens) scheduled
    for view in queue:
        if view not in alive:
            continue
        if budget <= 0 or len(grown) >= snapshot.max_num_seqs or not view.resident:
            continue
        num_new = min(num_pending_tokens(view), budget)
        need = blocks_for(view.num_computed_tokens + num_new, snapshot.block_size)
        need = max(0, need - view.num_blocks_hbm)
        while need > free and view in alive:
            victim = _pick_victim(alive, order_key)
            alive.remove(victim)
            plan.preempt_ids.append(victim.request_id)
            blocks_back, tokens_back = grown.pop(victim.request_id, (0, 0))
            free += victim.num_blocks_hbm + blocks_back
            budget += tokens_back
        if view not in alive:
            continue
        free -= need
        budget -= num_new
        grown[view.request_id] = (need, num_new)
    plan.schedule = [ScheduledChunk(rid, tokens) for rid, (_, tokens) in grown.items()]
    return free


def _resume_rotary(snapshot: Snapshot, rotary: list[RequestView], free: int, plan: Plan) -> int:
    for view in sorted(rotary, key=lambda v: (v.t_arr_s, v.arrival_seq)):
        blocks = demand_blocks(view, snapshot.block_size)
        if blocks > free:
            break
        plan.resume_ids.append(view.request_id)
        free -= blocks
    return free


def _admit_waiting(
    snapshot: Snapshot, waiting: list[RequestView], free: int, plan: Plan
) -> None:
    budget = snapshot.max_num_batched_tokens - plan.num_scheduled_tokens
    num_running = sum(1 for v in snapshot.requests if v.state.value == "running")
    num_seqs = num_running + len(plan.resume_ids)
    for view in waiting:
        if budget <= 0 or num_seqs >= snapshot.max_num_seqs:
            break
        num_new = min(num_pending_tokens(view), budget)
        need = blocks_for(num_new, snapshot.block_size)
        if need > free:
            break
        plan.admit_ids.append(view.request_id)
        plan.schedule.append(ScheduledChunk(view.request_id, num_new))
        free -= need
        budget -= num_new
        num_seqs += 1
