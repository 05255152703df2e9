"""The policy math one request at a time, as the docs state it: the reference the product's
one (columnar) definition of each is held to by property tests (tests/shared/test_policy_*.py).

VLT (``vlt``: ``shared.policy.vlt.vlt_array``), blk(r) (``demand_blocks``:
``shared.policy.joining.candidate_blocks``), the running requests' growth
(``reference_growth``: ``shared.policy.joining.running_growth``) and batch packing
(``pack_schedule``: ``shared.policy.packing.pack_columns``). Test code only: the product never
imports it.
"""

from __future__ import annotations

from shared.policy.common import num_pending_tokens
from shared.policy.types import Knobs, RequestState, RequestView, ScheduledChunk, Snapshot


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def vlt(
    view: RequestView, t_now_s: float, knobs: Knobs, loosest_ttft_s: float | None = None
) -> float:
    """How far ``view`` is behind its SLO at ``t_now_s`` (positive: lagging).

    rotary:  alpha * ReLU(t_now - t_last - beta_B * S_B)
    waiting:         ReLU(t_now - t_arr  - beta_F * S_F)
    running:       -(t_now - t_run)
    A request's own S_F/S_B (its SLO class) override the global knobs. A missing t_run or
    t_last falls back to the arrival time. With ``tpot_lag`` a rotary request that has a first
    token counts from t_first + (n - 1) * S_B - tpot_headroom_s (its n-th token's time at
    exactly S_B per token, less the headroom) instead of t_last, and a running one is ahead
    by its schedule's excess over t_now too (no headroom); ``max_pause_s`` caps the schedule
    at t_last + max_pause_s and the excess at max_pause_s. With
    ``deadline_lag`` and ``loosest_ttft_s`` (the loosest S_F among the snapshot's waiting
    requests) a waiting request's lag before the ReLU gains (1 - beta_F) * (loosest - S_F): it
    counts from its deadline.
    """
    if view.state is RequestState.RUNNING:
        t_run = view.t_run_s if view.t_run_s is not None else view.t_arr_s
        ahead = t_now_s - t_run
        if knobs.tpot_lag and view.t_first_s is not None:
            s_b = view.slo_tbt_s if view.slo_tbt_s is not None else knobs.slo_tbt_s
            due = view.t_first_s + max(0, view.num_output_tokens - 1) * s_b
            credit = max(0.0, due - t_now_s)
            if knobs.max_pause_s is not None:
                credit = min(credit, knobs.max_pause_s)
            ahead = ahead + credit
        return -ahead
    if view.state is RequestState.ROTARY:
        slo_tbt_s = view.slo_tbt_s if view.slo_tbt_s is not None else knobs.slo_tbt_s
        t_last = view.t_last_s if view.t_last_s is not None else view.t_arr_s
        if knobs.tpot_lag and view.t_first_s is not None:
            due = view.t_first_s + max(0, view.num_output_tokens - 1) * slo_tbt_s
            if knobs.max_pause_s is not None:  # back before a pause of max_pause_s
                due = min(due, t_last + knobs.max_pause_s)
            t_last = due - knobs.tpot_headroom_s
        return knobs.alpha * max(0.0, t_now_s - t_last - knobs.beta_b * slo_tbt_s)
    slo_ttft_s = view.slo_ttft_s if view.slo_ttft_s is not None else knobs.slo_ttft_s
    lag = t_now_s - view.t_arr_s - knobs.beta_f * slo_ttft_s
    if knobs.deadline_lag and loosest_ttft_s is not None:
        lag = lag + (1.0 - knobs.beta_f) * (loosest_ttft_s - slo_ttft_s)
    return max(0.0, lag)


def loosest_waiting_ttft(snapshot: Snapshot, knobs: Knobs) -> float | None:
    """The loosest S_F among ``snapshot``'s waiting requests (None: none waits)."""
    slos = [
        v.slo_ttft_s if v.slo_ttft_s is not None else knobs.slo_ttft_s
        for v in snapshot.requests
        if v.state is RequestState.WAITING
    ]
    return max(slos) if slos else None


def snapshot_vlt(view: RequestView, snapshot: Snapshot, knobs: Knobs) -> float:
    """:func:`vlt` of ``view`` as one of ``snapshot``'s requests (at its time)."""
    return vlt(view, snapshot.t_now_s, knobs, loosest_waiting_ttft(snapshot, knobs))


def demand_blocks(view: RequestView, block_size: int) -> int:
    """blk(r): the HBM blocks ``view`` needs to run (SUPERINFER.md §4): a running request what
    it holds; a waiting one its whole KV less its cached prefix blocks in HBM and in use; a
    rotary one its whole KV (an upper bound on what resuming it allocates)."""
    if view.state is RequestState.RUNNING:
        return view.num_blocks_hbm
    if view.state is RequestState.WAITING:  # cached prefix blocks in use are shared, not new
        return blocks_for(view.num_tokens, block_size) - view.num_blocks_hbm
    return blocks_for(view.num_tokens, block_size)


def reference_growth(snapshot: Snapshot) -> dict[str, int]:
    """Each resident running request's new blocks this step, as the batch packs them:
    decodes first (a block at a block boundary), then prefills in running order sharing what
    the decodes leave of the token budget and the seats (written from the docs, loop by
    loop). Requests whose KV is still arriving are left out (they grow by nothing)."""
    bs = snapshot.block_size
    running = [v for v in snapshot.requests if v.state is RequestState.RUNNING and v.resident]
    decodes = [v for v in running if v.num_computed_tokens > 0 and num_pending_tokens(v) == 1]
    growth = {
        v.request_id: max(0, v.num_computed_tokens // bs + 1 - v.num_blocks_hbm) for v in decodes
    }
    budget = snapshot.max_num_batched_tokens - len(decodes)
    seats = snapshot.max_num_seqs - len(decodes)
    for view in running:
        if view.request_id in growth or num_pending_tokens(view) <= 0:
            continue
        num_new = max(0, min(num_pending_tokens(view), budget)) if seats > 0 else 0
        budget, seats = budget - num_new, seats - 1
        end = view.num_computed_tokens + num_new
        growth[view.request_id] = (
            max(0, blocks_for(end, bs) - view.num_blocks_hbm) if num_new else 0
        )
    return growth


def pack_schedule(
    views: list[RequestView], snapshot: Snapshot, num_free_blocks: int
) -> list[ScheduledChunk]:
    """Pack a running set into one batch: decodes first, then prefill chunks, each group in the
    given order, within the token budget, ``max_num_seqs`` and ``num_free_blocks`` new blocks.

    A prefill chunk shrinks to the tokens its blocks can hold; a request that cannot get a
    single token in is skipped (the rest are still tried). Requests whose KV is not resident
    yet (an H2D copy in flight) sit this iteration out.
    """
    bs = snapshot.block_size
    budget = snapshot.max_num_batched_tokens
    seats = snapshot.max_num_seqs
    schedule: list[ScheduledChunk] = []
    prefills: list[RequestView] = []
    for view in views:  # decodes: one token each, a new block at a block boundary
        computed = view.num_computed_tokens
        pending = view.num_tokens - computed
        if pending != 1 or computed <= 0:
            if pending > 0:
                prefills.append(view)
            continue
        if seats <= 0 or budget <= 0:
            return schedule
        if view.resident:
            grow = computed // bs + 1 - view.num_blocks_hbm
            if grow > 0:
                if grow > num_free_blocks:
                    continue
                num_free_blocks -= grow
            schedule.append(ScheduledChunk(view.request_id, 1))
            budget -= 1
            seats -= 1
    for view in prefills:
        if seats <= 0 or budget <= 0:
            break
        computed, held = view.num_computed_tokens, view.num_blocks_hbm
        num_new = min(view.num_tokens - computed, budget, (held + num_free_blocks) * bs - computed)
        if num_new <= 0 or not view.resident:
            continue
        num_free_blocks -= max(0, blocks_for(computed + num_new, bs) - held)
        schedule.append(ScheduledChunk(view.request_id, num_new))
        budget -= num_new
        seats -= 1
    return schedule
