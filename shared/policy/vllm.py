"""vLLM V1's scheduler decisions (SUPERINFER.md §7), as a pure function over a snapshot.

FCFS (or priority: lower value first, arrival breaks ties); running requests first (decodes,
then prefill chunks) within ``max_num_batched_tokens``; when a running request cannot get a
block, the last running request (the worst priority under ``priority``) is preempted by
recompute, repeatedly, possibly the request itself; a step that preempted admits nobody new.
Waiting admission stops at the first request that does not fit (head-of-line blocking, as in
vLLM). Rotary requests (left over when an operator switches from a rotating policy) are
resumed before any admission.

vLLM V1 walks its running list in order; "decodes first" here is SUPERINFER.md's reading of
it (in V1 the running list is admission order, so partial prefills sit near its end). Victims
are still taken from the end of the running list, as V1's ``self.running.pop()`` does.

That walk (allocate or preempt, request by request; admission blocked at the first misfit)
is vLLM's own and stays here; blk(r) and the swap mode's re-pack use the product's one
definition (``candidate_blocks``, ``pack_columns``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shared.policy.columns import columns_from_views, pick_ids
from shared.policy.common import arrival_key, is_decode, make_chunks, split_snapshot
from shared.policy.joining import candidate_blocks
from shared.policy.packing import pack_columns
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
    full or they have no KV), and a step that starts with any request swapped out resumes them
    first, in arrival order, and admits nobody new. The batch of a step that rotated out is
    re-packed counting none of the rotated-out victims' blocks free (see
    :func:`_swap_instead_of_recompute`).
    """
    running, waiting, rotary = split_snapshot(snapshot)
    if order_key is not None:
        waiting.sort(key=order_key)
    plan = Plan()
    free = _schedule_running(snapshot, running, plan, order_key)
    if swap and plan.preempt_ids:
        _swap_instead_of_recompute(snapshot, plan)
    if plan.preempt_ids or plan.rotate_out_ids:
        return plan
    free = _resume_rotary(snapshot, rotary, free, plan, len(running))
    if swap and rotary:
        return plan  # V0: a step that starts with swapped requests schedules no new prefill
    _admit_waiting(snapshot, waiting, free, plan, len(running) + len(plan.resume_ids))
    return plan


def priority_key(view: RequestView) -> tuple[float, float, int]:
    return (view.priority, view.t_arr_s, view.arrival_seq)


def _pick_victim(alive: list[RequestView], order_key: OrderKey | None) -> RequestView:
    """The last running request (running-list order), or the worst by ``order_key``."""
    if order_key is not None:
        return max(alive, key=order_key)
    return alive[-1]


def _schedule_running(
    snapshot: Snapshot, running: list[RequestView], plan: Plan, order_key: OrderKey | None
) -> int:
    """Decodes, then running prefill chunks; preempt on block shortage. Returns free blocks."""
    free = snapshot.num_free_hbm_blocks
    budget = snapshot.max_num_batched_tokens
    bs = snapshot.block_size
    alive = list(running)  # victims come from here, in running-list order
    gone: set[str] = set()
    grown: dict[str, tuple[int, int]] = {}  # request id -> (new blocks, tokens) scheduled
    for view in [v for v in running if is_decode(v)] + [v for v in running if not is_decode(v)]:
        if budget <= 0:
            break  # V1 stops walking the running list once the token budget is spent
        rid = view.request_id
        if rid in gone or not view.resident or len(grown) >= snapshot.max_num_seqs:
            continue
        num_new = min(view.num_tokens - view.num_computed_tokens, budget, _cap(snapshot))
        if num_new <= 0:
            continue
        need = max(0, -(-(view.num_computed_tokens + num_new) // bs) - view.num_blocks_hbm)
        while need > free and rid not in gone:
            victim = _pick_victim(alive, order_key)
            alive.remove(victim)
            gone.add(victim.request_id)
            plan.preempt_ids.append(victim.request_id)
            blocks_back, tokens_back = grown.pop(victim.request_id, (0, 0))
            free += victim.num_blocks_hbm + blocks_back
            budget += tokens_back
        if rid in gone:
            continue
        free -= need
        budget -= num_new
        grown[rid] = (need, num_new)
    plan.schedule = [ScheduledChunk(rid, tokens) for rid, (_, tokens) in grown.items()]
    return free


def _cap(snapshot: Snapshot) -> int:
    """The most tokens one chunk takes: V1's ``long_prefill_token_threshold`` (0: none)."""
    threshold = snapshot.long_prefill_token_threshold
    return threshold if threshold > 0 else snapshot.max_num_batched_tokens


def _swap_instead_of_recompute(snapshot: Snapshot, plan: Plan) -> None:
    """V0 swap mode: victims with KV go to DRAM while it has room for their unsynced blocks
    (a victim whose KV is still being copied in is recomputed: V0 never preempts mid-swap-in).
    The engine drops a victim's synced HBM blocks at once and frees the others when their D2H
    copy completes; this plan counts none of them: the batch is re-packed with only the
    recompute victims' blocks freed (a request that needed the rest waits a step)."""
    views = {v.request_id: v for v in snapshot.requests}
    free_dram = snapshot.num_free_dram_blocks
    recompute: list[str] = []
    for request_id in plan.preempt_ids:
        view = views[request_id]
        dram_needed = max(0, view.num_blocks_hbm - view.num_blocks_dram)
        if view.resident and view.num_computed_tokens > 0 and dram_needed <= free_dram:
            plan.rotate_out_ids.append(request_id)
            free_dram -= dram_needed
        else:
            recompute.append(request_id)
    plan.preempt_ids = recompute
    if plan.rotate_out_ids:
        free = snapshot.num_free_hbm_blocks + sum(views[r].num_blocks_hbm for r in recompute)
        batch = columns_from_views([views[chunk.request_id] for chunk in plan.schedule])
        rows, tokens = pack_columns(
            batch,
            np.arange(len(batch)),
            snapshot.block_size,
            snapshot.max_num_batched_tokens,
            snapshot.max_num_seqs,
            free,
            snapshot.long_prefill_token_threshold,
        )
        plan.schedule = make_chunks(pick_ids(batch.request_ids, rows), tokens)


def _resume_rotary(
    snapshot: Snapshot, rotary: list[RequestView], free: int, plan: Plan, num_seqs: int
) -> int:
    """Resume rotary requests in arrival order while their blocks and a seat are free; the
    first that does not fit blocks the rest. One whose rotate-out copy is still in flight
    (it still holds HBM blocks) is not ready and is passed over. Resumed ones run once their
    H2D copy is done."""
    seats = snapshot.max_num_seqs - num_seqs
    for view in sorted(rotary, key=arrival_key):
        if view.num_blocks_hbm:
            continue
        blocks = candidate_blocks(view.num_tokens, view.num_blocks_hbm, False, snapshot.block_size)
        if blocks > free or seats <= 0:
            break
        plan.resume_ids.append(view.request_id)
        free -= blocks
        seats -= 1
    return free


def _admit_waiting(
    snapshot: Snapshot, waiting: list[RequestView], free: int, plan: Plan, num_seqs: int
) -> None:
    """Admit in queue order while the token budget, a seat and the blocks for the first
    chunk are there; the first request that does not fit blocks the ones behind it."""
    budget = snapshot.max_num_batched_tokens - plan.num_scheduled_tokens
    for view in waiting:
        if budget <= 0 or num_seqs >= snapshot.max_num_seqs:
            break
        num_new = min(view.num_tokens - view.num_computed_tokens, budget, _cap(snapshot))
        end = view.num_computed_tokens + num_new
        need = max(0, -(-end // snapshot.block_size) - view.num_blocks_hbm)
        if need > free or num_new <= 0 or not view.resident:
            break
        plan.admit_ids.append(view.request_id)
        plan.schedule.append(ScheduledChunk(view.request_id, num_new))
        free -= need
        budget -= num_new
        num_seqs += 1
