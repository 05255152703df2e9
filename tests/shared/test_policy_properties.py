"""Every policy's plan is executable by the engine, on random snapshots (hypothesis).

The block invariant mirrors data_plane/engine/engine.py: preemptions free their HBM blocks
before anything is allocated; rotations out drop their synced HBM blocks at once and keep
the others until their D2H copy completes; each resume allocates the HBM its KV is copied
into (at most blk(r), SUPERINFER.md §4) before the batch's chunks allocate, in schedule
order. So the batch's new blocks plus the resumes' blocks must fit in the free HBM plus the
preempted requests' blocks plus the victims' synced ones. The product's one blk(r) and growth
are held to their references (tests/shared/policy_reference.py) here too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy import (
    POLICY_NAMES,
    Knobs,
    Plan,
    RequestState,
    RequestView,
    Snapshot,
    columnar_from_snapshot,
    columns_from_views,
    make_plan,
    nothing_to_decide,
)
from shared.policy.columns import RUNNING_CODE, WAITING_CODE
from shared.policy.joining import candidate_blocks, running_growth
from tests.shared.policy_reference import (
    blocks_for,
    demand_blocks,
    reference_growth,
    snapshot_vlt,
)

T_NOW = 50.0
STATES = (RequestState.RUNNING, RequestState.WAITING, RequestState.ROTARY)


@st.composite
def request_views(draw: st.DrawFn, index: int, block_size: int) -> RequestView:
    state = draw(st.sampled_from(STATES))
    num_tokens = draw(st.integers(1, 80))
    t_arr = draw(st.floats(0.0, T_NOW, allow_nan=False))
    view = RequestView(
        request_id=f"r{index}",
        state=state,
        t_arr_s=t_arr,
        num_tokens=num_tokens,
        priority=draw(st.integers(0, 3)),
        arrival_seq=index,
        slo_ttft_s=draw(st.none() | st.floats(0.5, 20.0)),
        slo_tbt_s=draw(st.none() | st.floats(0.01, 1.0)),
    )
    if state is RequestState.WAITING:
        return view
    t_since = draw(st.floats(t_arr, T_NOW, allow_nan=False))
    if state is RequestState.ROTARY:
        computed = draw(st.integers(0, num_tokens - 1))
        dram = blocks_for(computed, block_size)
        evicting = draw(st.integers(0, 2))  # > 0: its rotate-out copy is still in flight
        first = draw(st.none() | st.floats(t_arr, t_since, allow_nan=False))
        return view._replace(
            num_computed_tokens=computed,
            num_blocks_hbm=min(evicting, dram),
            num_blocks_dram=dram,
            t_last_s=t_since,
            t_first_s=first,
            num_output_tokens=0 if first is None else draw(st.integers(1, 200)),
        )
    computed = draw(st.integers(0, num_tokens))  # pending 0 cannot happen; must not break
    hbm = blocks_for(computed, block_size) + draw(st.integers(0, 1))
    t_last = draw(st.none() | st.floats(t_arr, T_NOW, allow_nan=False))
    first = None if t_last is None else draw(st.none() | st.floats(t_arr, t_last))
    return view._replace(
        num_computed_tokens=computed,
        num_blocks_hbm=hbm,
        num_blocks_dram=draw(st.integers(0, hbm)),
        t_run_s=t_since,
        t_last_s=t_last,
        resident=draw(st.booleans()),
        t_first_s=first,
        num_output_tokens=0 if first is None else draw(st.integers(1, 400)),
    )


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    block_size = draw(st.sampled_from((1, 4, 16)))
    n = draw(st.integers(0, 12))
    views = [draw(request_views(i, block_size)) for i in range(n)]
    num_running = sum(v.state is RequestState.RUNNING for v in views)
    return Snapshot(
        t_now_s=T_NOW,
        requests=tuple(draw(st.permutations(views))),
        num_free_hbm_blocks=draw(st.integers(0, 40)),
        num_free_dram_blocks=draw(st.integers(0, 40)),
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(1, 200)),
        max_num_seqs=draw(st.integers(max(1, num_running), num_running + 6)),
        b_xfer_blocks=draw(st.integers(0, 40)),
    )


knobs_strategy = st.builds(
    Knobs,
    alpha=st.floats(0.0, 5.0),
    beta_b=st.floats(-2.0, 2.0),
    beta_f=st.floats(0.0, 2.0),
    slo_ttft_s=st.floats(0.5, 10.0),
    slo_tbt_s=st.floats(0.01, 1.0),
    min_residency_s=st.sampled_from([0.0, 0.0, 0.05, 0.5, 5.0]),
    rotate_only_for_lag=st.booleans(),
    protect_unserved=st.booleans(),
    hold_room_for_rotary=st.booleans(),
    deadline_lag=st.booleans(),
    residency_yields_to_tighter=st.booleans(),
    demote_late_s=st.none() | st.floats(0.0, 10.0),
    lag_per_block=st.booleans(),
    tpot_lag=st.booleans(),
    tpot_headroom_s=st.sampled_from([0.0, 0.5, 2.0]),
    max_pause_s=st.none() | st.sampled_from([0.5, 1.0, 5.0]),
)


def check_transitions(snapshot: Snapshot, plan: Plan) -> None:
    state = {v.request_id: v.state for v in snapshot.requests}
    lists = (plan.admit_ids, plan.resume_ids, plan.rotate_out_ids, plan.preempt_ids)
    wanted = (RequestState.WAITING, RequestState.ROTARY, RequestState.RUNNING, RequestState.RUNNING)
    for ids, required in zip(lists, wanted, strict=True):
        assert all(state.get(rid) is required for rid in ids), (ids, required)
    every = [rid for ids in lists for rid in ids]
    assert len(every) == len(set(every)), "an id in two transition lists (or twice in one)"
    views = {v.request_id: v for v in snapshot.requests}
    assert all(views[rid].num_blocks_hbm == 0 for rid in plan.resume_ids), "rotate-out in flight"
    num_running = sum(s is RequestState.RUNNING for s in state.values())
    after = num_running - len(plan.rotate_out_ids) - len(plan.preempt_ids)
    assert after + len(plan.admit_ids) + len(plan.resume_ids) <= snapshot.max_num_seqs


def check_schedule(snapshot: Snapshot, plan: Plan) -> None:
    views = {v.request_id: v for v in snapshot.requests}
    leaving = set(plan.rotate_out_ids) | set(plan.preempt_ids)
    scheduled = [chunk.request_id for chunk in plan.schedule]
    assert len(scheduled) == len(set(scheduled)) <= snapshot.max_num_seqs
    assert set(plan.admit_ids) <= set(scheduled), "an admitted request must get a chunk"
    assert plan.num_scheduled_tokens <= snapshot.max_num_batched_tokens
    for chunk in plan.schedule:
        view = views[chunk.request_id]
        if view.state is RequestState.WAITING:
            assert chunk.request_id in plan.admit_ids
        else:  # running, staying, with its KV resident (not just resumed: rotary)
            assert view.state is RequestState.RUNNING and chunk.request_id not in leaving
        assert view.resident
        assert 1 <= chunk.num_tokens <= view.num_tokens - view.num_computed_tokens


def check_blocks(snapshot: Snapshot, plan: Plan) -> None:
    views = {v.request_id: v for v in snapshot.requests}
    bs = snapshot.block_size
    freed = sum(views[rid].num_blocks_hbm for rid in plan.preempt_ids)
    freed += sum(freed_now(views[rid]) for rid in plan.rotate_out_ids)
    resumed = sum(demand_blocks(views[rid], bs) for rid in plan.resume_ids)
    grown = 0
    for chunk in plan.schedule:
        view = views[chunk.request_id]
        end = view.num_computed_tokens + chunk.num_tokens
        grown += max(0, blocks_for(end, bs) - view.num_blocks_hbm)
    assert grown + resumed <= snapshot.num_free_hbm_blocks + freed
    dram = sum(
        max(0, views[rid].num_blocks_hbm - views[rid].num_blocks_dram)
        for rid in plan.rotate_out_ids
    )
    assert dram <= snapshot.num_free_dram_blocks


def freed_now(view: RequestView) -> int:
    return min(view.num_blocks_hbm, max(0, view.num_blocks_dram))


def l_key(view: RequestView, snapshot: Snapshot, knobs: Knobs) -> tuple[Any, ...]:
    """L's order for the head: VLT descending (with ``lag_per_block``, a lagging request's
    VLT per block of its blk(r)), requests late by ``demote_late_s`` last, those not lagging
    before them (``rotate_only_for_lag``), and within each of these the best priority band
    first."""
    late = is_late(view, snapshot, knobs)
    rank = snapshot_vlt(view, snapshot, knobs)
    if knobs.lag_per_block and rank > 0:
        rank /= max(1, demand_blocks(view, snapshot.block_size))
    not_lagging = knobs.rotate_only_for_lag and rank <= 0  # scanned after the lagging ones
    return (late, not_lagging, view.priority, -rank, view.t_arr_s, view.arrival_seq)


def ttft_slo(view: RequestView, knobs: Knobs) -> float:
    return view.slo_ttft_s if view.slo_ttft_s is not None else knobs.slo_ttft_s


def is_late(view: RequestView, snapshot: Snapshot, knobs: Knobs) -> bool:
    """Waiting without a first token, its TTFT SLO missed by more than ``demote_late_s``."""
    if knobs.demote_late_s is None or view.state is not RequestState.WAITING:
        return False
    missed_by = snapshot.t_now_s - view.t_arr_s - ttft_slo(view, knobs)
    return view.t_last_s is None and missed_by > knobs.demote_late_s


def yields(view: RequestView, snapshot: Snapshot, knobs: Knobs) -> bool:
    """``residency_yields_to_tighter``: a waiting request of a tighter class lags."""
    lagging = [
        ttft_slo(v, knobs)
        for v in snapshot.requests
        if v.state is RequestState.WAITING and snapshot_vlt(v, snapshot, knobs) > 0
    ]
    tighter = bool(lagging) and ttft_slo(view, knobs) > min(lagging)
    return knobs.residency_yields_to_tighter and tighter


def settled(view: RequestView, snapshot: Snapshot, knobs: Knobs) -> bool:
    """Past the tail scan's guards (no shortage)."""
    score = snapshot_vlt(view, snapshot, knobs)
    young = knobs.min_residency_s > 0 and not score < -knobs.min_residency_s
    if young and not yields(view, snapshot, knobs):
        return False
    t_last, t_run = view.t_last_s, view.t_run_s
    served = t_last is not None and (t_run is None or t_last >= t_run)
    return served or not knobs.protect_unserved


def check_lvf(snapshot: Snapshot, knobs: Knobs, plan: Plan) -> None:
    """Algorithm 1 (SUPERINFER.md §4) and the documented extensions, held against the plan."""
    views = {v.request_id: v for v in snapshot.requests}
    bs = snapshot.block_size
    growth_of = reference_growth(snapshot)
    growth = sum(growth_of.values())
    candidates = [v for v in snapshot.requests if v.state is not RequestState.RUNNING]
    demand = sum(demand_blocks(v, bs) for v in candidates)
    # those that can start: a rotary request whose copy out is in flight (HBM blocks) cannot
    num_ready = sum(v.state is RequestState.WAITING or v.num_blocks_hbm == 0 for v in candidates)
    seats_free = snapshot.max_num_seqs - (len(snapshot.requests) - len(candidates))
    uncontended = num_ready <= max(0, seats_free)  # ours: seats are contended too
    assert plan.fcfs_fallback == (  # step 1
        snapshot.num_free_hbm_blocks - growth >= demand and uncontended
    )
    if plan.fcfs_fallback:
        assert not plan.rotate_out_ids and not plan.preempt_ids
        return
    shortage = growth - snapshot.num_free_hbm_blocks
    for rid in plan.rotate_out_ids:
        view = views[rid]
        assert snapshot_vlt(view, snapshot, knobs) < 0 and view.resident and view.num_blocks_hbm
        if shortage <= 0:  # the guards hold unless the running requests' growth is short
            assert settled(view, snapshot, knobs)
    if shortage <= 0:
        assert not plan.preempt_ids  # rotation never turns into recompute
    rotated = [views[r] for r in plan.rotate_out_ids]
    credit = {r.request_id: r.num_blocks_hbm + growth_of.get(r.request_id, 0) for r in rotated}
    check_recompute_victims(snapshot, plan, shortage - sum(credit.values()))
    joined = [views[r] for r in plan.admit_ids + plan.resume_ids]
    room = -shortage + sum(freed_now(r) + growth_of.get(r.request_id, 0) for r in rotated)
    assert sum(demand_blocks(v, bs) for v in joined) <= max(0, room)  # step 5: what is freed
    check_head_order(snapshot, knobs, plan, joined)
    check_tail_order(snapshot, knobs, plan, rotated, shortage)
    # every running request holds a seat, a rotating-in one (not yet resident, no growth) too
    num_running = len(snapshot.requests) - len(candidates)
    if rotated and len(rotated) > len(candidates) - (snapshot.max_num_seqs - num_running):
        b_swap_max = snapshot.b_xfer_blocks + max(0, shortage)
        last = rotated_in_tail_order(rotated, snapshot, knobs)[-1]
        assert sum(credit.values()) - credit[last.request_id] < b_swap_max  # stops when paid


def rotated_in_tail_order(
    rotated: list[RequestView], snapshot: Snapshot, knobs: Knobs
) -> list[RequestView]:
    return sorted(
        rotated,
        key=lambda v: (-v.priority, snapshot_vlt(v, snapshot, knobs), -v.t_arr_s, -v.arrival_seq),
    )


def check_head_order(
    snapshot: Snapshot, knobs: Knobs, plan: Plan, joined: list[RequestView]
) -> None:
    """The head takes the largest-VLT requests that fit: a candidate ranked above one that
    joined, left out, was too big, still rotating out, or a waiting request passed by a
    resume (admission needs a chunk too) or, with ``deadline_lag``, by a waiting request of an
    earlier TTFT deadline or one not yet missed (the batch packs prefills by deadline, missed
    ones last; with ``lag_per_block`` the head may rank the other first)."""
    joined_ids = {v.request_id for v in joined}
    bs = snapshot.block_size
    left_out = [
        v for v in snapshot.requests
        if v.state is not RequestState.RUNNING and v.request_id not in joined_ids
    ]  # fmt: skip
    for j in joined:
        for c in left_out:
            if l_key(c, snapshot, knobs) >= l_key(j, snapshot, knobs):
                continue
            assert (
                c.num_blocks_hbm > 0
                or demand_blocks(c, bs) > demand_blocks(j, bs)
                or (c.state is RequestState.WAITING and j.state is RequestState.ROTARY)
                or packed_first_by_deadline(j, c, knobs, snapshot.t_now_s)
            ), (c, j)


def packed_first_by_deadline(
    first: RequestView, then: RequestView, knobs: Knobs, t_now_s: float
) -> bool:
    """With ``deadline_lag``, whether waiting ``first``'s prefill may pack before ``then``'s:
    by TTFT deadline, a deadline already missed without a first token last."""
    if not (knobs.deadline_lag and first.state is then.state is RequestState.WAITING):
        return False
    keys = [
        (view.t_last_s is None and deadline < t_now_s, deadline)
        for view in (first, then)
        for deadline in [view.t_arr_s + ttft_slo(view, knobs)]
    ]
    return keys[0] < keys[1]


def check_tail_order(
    snapshot: Snapshot, knobs: Knobs, plan: Plan, rotated: list[RequestView], shortage: int
) -> None:
    """The tail takes the lowest-VLT eligible requests of the worst priority band first, and
    no request of a better band than every one joining: one staying, eligible and ahead of a
    victim in tail order, must have lacked DRAM room."""
    if not rotated or shortage > 0:
        return
    leaving = set(plan.rotate_out_ids) | set(plan.preempt_ids)
    # room is made for the chosen (who join once it is free): never of a better band than all
    candidates = [v.priority for v in snapshot.requests if v.state is not RequestState.RUNNING]
    assert min(v.priority for v in rotated) >= min(candidates)
    order = rotated_in_tail_order(rotated, snapshot, knobs)
    last = order[-1]
    last_key = (-last.priority, snapshot_vlt(last, snapshot, knobs), -last.t_arr_s)
    for u in snapshot.requests:
        if u.state is not RequestState.RUNNING or u.request_id in leaving:
            continue
        score = snapshot_vlt(u, snapshot, knobs)
        eligible = score < 0 and u.resident and u.num_blocks_hbm and settled(u, snapshot, knobs)
        if eligible and (-u.priority, score, -u.t_arr_s) < last_key:
            assert u.num_blocks_hbm > u.num_blocks_dram, u


def check_recompute_victims(snapshot: Snapshot, plan: Plan, shortage: int) -> None:
    """LVF recomputes only for a real shortage (the running requests' growth over the free
    HBM, less what rotates out), and then the worst priority band's newest running requests
    first, as vLLM: the
    shortest prefix of the running list, from its end, that covers it (requests rotating
    out, holding no block or whose KV is still arriving passed over)."""
    if not plan.preempt_ids:
        return
    views = {v.request_id: v for v in snapshot.requests}
    rotating = set(plan.rotate_out_ids)
    eligible = [
        v.request_id
        for v in reversed(snapshot.requests)
        if v.state is RequestState.RUNNING
        and v.request_id not in rotating
        and v.num_blocks_hbm
        and v.resident
    ]
    eligible.sort(key=lambda r: -views[r].priority)  # the worst band's newest first (stable)
    assert plan.preempt_ids == eligible[: len(plan.preempt_ids)]
    held = [views[r].num_blocks_hbm for r in plan.preempt_ids]
    assert sum(held) - held[-1] < shortage


def check_baseline(snapshot: Snapshot, name: str, plan: Plan) -> None:
    if plan.preempt_ids or plan.rotate_out_ids:
        assert not plan.admit_ids and not plan.resume_ids, "a step that preempted admits nobody"
    if name == "vllm" or name == "vllm-priority":
        assert not plan.rotate_out_ids  # V1 has no swap
    has_rotary = any(v.state is RequestState.ROTARY for v in snapshot.requests)
    if name in ("swap", "edf") and has_rotary:
        assert not plan.admit_ids, "swap mode admits nobody while a request is swapped out"


@settings(max_examples=400, deadline=None)
@given(snapshot=snapshots(), knobs=knobs_strategy)
def test_every_policy_makes_an_executable_plan(snapshot: Snapshot, knobs: Knobs) -> None:
    for name in POLICY_NAMES:
        policy_knobs = replace(knobs, policy=name)  # every knob drawn, residency included
        plan = make_plan(snapshot, policy_knobs)
        check_transitions(snapshot, plan)
        check_schedule(snapshot, plan)
        check_blocks(snapshot, plan)
        if name == "lvf":
            check_lvf(snapshot, policy_knobs, plan)
        else:
            check_baseline(snapshot, name, plan)
        assert make_plan(snapshot, policy_knobs) == plan  # pure: same snapshot, same plan


@st.composite
def quiet_snapshots(draw: st.DrawFn) -> Snapshot:
    """Only running, resident requests; free HBM around their growth (reference_growth)."""
    snapshot = draw(snapshots())
    running = tuple(
        v._replace(resident=True) for v in snapshot.requests if v.state is RequestState.RUNNING
    )
    quiet = replace(snapshot, requests=running)
    growth = sum(reference_growth(quiet).values())
    return replace(quiet, num_free_hbm_blocks=max(0, growth + draw(st.integers(-2, 3))))


@settings(max_examples=300, deadline=None)
@given(snapshot=quiet_snapshots() | snapshots(), knobs=knobs_strategy)
def test_nothing_to_decide_means_no_policy_moves_a_request(
    snapshot: Snapshot, knobs: Knobs
) -> None:
    """The worker skips planning where :func:`nothing_to_decide` holds: every policy's plan
    must then admit, resume, rotate out and preempt nobody; it holds exactly when all requests
    run resident and the free HBM covers the reference growth."""
    quiet = nothing_to_decide(snapshot)
    all_resident = all(v.state is RequestState.RUNNING and v.resident for v in snapshot.requests)
    growth = sum(reference_growth(snapshot).values())
    assert quiet == (all_resident and snapshot.num_free_hbm_blocks >= growth)
    if not quiet:
        return
    for name in POLICY_NAMES:
        plan = make_plan(snapshot, replace(knobs, policy=name))
        moves = (plan.admit_ids, plan.resume_ids, plan.rotate_out_ids, plan.preempt_ids)
        assert moves == ([], [], [], []), name


@settings(max_examples=200, deadline=None)
@given(snapshot=snapshots(), knobs=knobs_strategy)
def test_vlt_is_signed_by_state(snapshot: Snapshot, knobs: Knobs) -> None:
    for view in snapshot.requests:
        score = snapshot_vlt(view, snapshot, knobs)
        assert score <= 0 if view.state is RequestState.RUNNING else score >= 0


@settings(max_examples=300, deadline=None)
@given(snapshot=snapshots())
def test_candidate_blocks_is_blk_of_every_waiting_and_rotary_request(snapshot: Snapshot) -> None:
    bs = snapshot.block_size
    columns = columns_from_views(snapshot.requests)
    waiting = columns.states == WAITING_CODE
    blk = candidate_blocks(columns.num_tokens, columns.num_blocks_hbm, waiting, bs)
    for view, got in zip(snapshot.requests, blk.tolist(), strict=True):
        if view.state is RequestState.RUNNING:
            continue
        assert got == demand_blocks(view, bs)
        is_waiting = view.state is RequestState.WAITING
        assert candidate_blocks(view.num_tokens, view.num_blocks_hbm, is_waiting, bs) == got


@settings(max_examples=300, deadline=None)
@given(snapshot=snapshots())
def test_running_growth_is_the_reference_growth(snapshot: Snapshot) -> None:
    columnar = columnar_from_snapshot(snapshot)
    running = np.flatnonzero(columnar.requests.states == RUNNING_CODE)
    growth = running_growth(columnar, running).tolist()
    expected = reference_growth(snapshot)
    for row, got in zip(running.tolist(), growth, strict=True):
        assert got == expected.get(snapshot.requests[row].request_id, 0)


@settings(max_examples=300, deadline=None)
@given(snapshot=snapshots(), knobs=knobs_strategy, slo=st.none() | st.floats(0.5, 20.0))
def test_one_slo_class_plans_as_without_the_class_knobs(
    snapshot: Snapshot, knobs: Knobs, slo: float | None
) -> None:
    """With every request in one TTFT class, ``deadline_lag`` and
    ``residency_yields_to_tighter`` change nothing: the same plan as with both off."""
    one_class = replace(
        snapshot, requests=tuple(v._replace(slo_ttft_s=slo) for v in snapshot.requests)
    )
    lvf = replace(knobs, policy="lvf")
    off = replace(lvf, deadline_lag=False, residency_yields_to_tighter=False)
    on = replace(lvf, deadline_lag=True, residency_yields_to_tighter=True)
    assert make_plan(one_class, on) == make_plan(one_class, off)
