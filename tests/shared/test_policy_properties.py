"""Every policy's plan is executable by the engine, on random snapshots (hypothesis).

The block invariant mirrors data_plane/engine/engine.py: preemptions free their HBM blocks
before anything is allocated; rotations out keep theirs until the D2H copy completes (not
free this iteration); each resume allocates the HBM its KV is copied into (at most blk(r),
SUPERINFER.md §4) before the batch's chunks allocate, in schedule order. So the batch's new
blocks plus the resumes' blocks must fit in the free HBM plus the preempted requests' blocks.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy import (
    POLICY_NAMES,
    Knobs,
    Plan,
    RequestState,
    RequestView,
    Snapshot,
    make_plan,
    vlt,
)
from shared.policy.common import blocks_for, demand_blocks
from shared.policy.lvf import _classify
from shared.policy.vlt import vlt_scores

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
        return view._replace(
            num_computed_tokens=computed,
            num_blocks_hbm=min(evicting, dram),
            num_blocks_dram=dram,
            t_last_s=t_since,
        )
    computed = draw(st.integers(0, num_tokens))  # pending 0 cannot happen; must not break
    hbm = blocks_for(computed, block_size) + draw(st.integers(0, 1))
    return view._replace(
        num_computed_tokens=computed,
        num_blocks_hbm=hbm,
        num_blocks_dram=draw(st.integers(0, hbm)),
        t_run_s=t_since,
        t_last_s=draw(st.none() | st.floats(t_arr, T_NOW, allow_nan=False)),
        resident=draw(st.booleans()),
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


def check_lvf(snapshot: Snapshot, knobs: Knobs, plan: Plan) -> None:
    views = {v.request_id: v for v in snapshot.requests}
    bs = snapshot.block_size
    growth = 0
    for view in snapshot.requests:
        if view.state is RequestState.RUNNING:
            num_new = min(
                view.num_tokens - view.num_computed_tokens, snapshot.max_num_batched_tokens
            )
            need = blocks_for(view.num_computed_tokens + num_new, bs) - view.num_blocks_hbm
            growth += max(0, need)
    demand = sum(
        demand_blocks(v, bs) for v in snapshot.requests if v.state is not RequestState.RUNNING
    )
    assert plan.fcfs_fallback == (snapshot.num_free_hbm_blocks - growth >= demand)  # step 1
    if plan.fcfs_fallback:
        assert not plan.rotate_out_ids and not plan.preempt_ids
        return
    for rid in plan.rotate_out_ids:
        view = views[rid]
        assert vlt(view, snapshot.t_now_s, knobs) < 0 and view.resident and view.num_blocks_hbm
    if growth <= snapshot.num_free_hbm_blocks:  # no shortage: only served requests leave
        assert not plan.preempt_ids  # and rotation never turns into recompute
        for rid in plan.rotate_out_ids:
            t_last, t_run = views[rid].t_last_s, views[rid].t_run_s
            assert t_last is not None and (t_run is None or t_last >= t_run)
    check_recompute_victims(snapshot, plan, growth)
    joined = sum(demand_blocks(views[r], bs) for r in plan.admit_ids + plan.resume_ids)
    b_left = snapshot.num_free_hbm_blocks - growth + snapshot.b_xfer_blocks
    assert joined <= max(0, b_left)
    # the tail scan stops as soon as B_swap = B_xfer - B_left is covered, and the head scan
    # never takes B_left below min(0, B_HBM + B_xfer)
    leaving = [views[r] for r in plan.rotate_out_ids]
    if leaving:  # in tail-scan order: VLT ascending, later arrival first
        leaving.sort(key=lambda v: (vlt(v, snapshot.t_now_s, knobs), -v.t_arr_s, -v.arrival_seq))
        rotated = sum(v.num_blocks_hbm for v in leaving)
        b_swap_max = max(snapshot.b_xfer_blocks, growth - snapshot.num_free_hbm_blocks)
        assert rotated - leaving[-1].num_blocks_hbm < b_swap_max


def check_recompute_victims(snapshot: Snapshot, plan: Plan, growth: int) -> None:
    """LVF recomputes only for a real shortage (the running requests' growth over the free
    HBM, less what rotates out), and then the newest running requests first, as vLLM: the
    shortest prefix of the running list, from its end, that covers it (requests rotating
    out, holding no block or whose KV is still arriving passed over)."""
    if not plan.preempt_ids:
        return
    views = {v.request_id: v for v in snapshot.requests}
    rotating = set(plan.rotate_out_ids)
    shortage = growth - snapshot.num_free_hbm_blocks
    shortage -= sum(views[r].num_blocks_hbm for r in rotating)
    eligible = [
        v.request_id
        for v in reversed(snapshot.requests)
        if v.state is RequestState.RUNNING
        and v.request_id not in rotating
        and v.num_blocks_hbm
        and v.resident
    ]
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
        policy_knobs = Knobs(
            policy=name,
            alpha=knobs.alpha,
            beta_b=knobs.beta_b,
            beta_f=knobs.beta_f,
            slo_ttft_s=knobs.slo_ttft_s,
            slo_tbt_s=knobs.slo_tbt_s,
        )
        plan = make_plan(snapshot, policy_knobs)
        check_transitions(snapshot, plan)
        check_schedule(snapshot, plan)
        check_blocks(snapshot, plan)
        if name == "lvf":
            check_lvf(snapshot, policy_knobs, plan)
        else:
            check_baseline(snapshot, name, plan)
        assert make_plan(snapshot, policy_knobs) == plan  # pure: same snapshot, same plan


@settings(max_examples=200, deadline=None)
@given(snapshot=snapshots(), knobs=knobs_strategy)
def test_vlt_scores_agree_with_vlt(snapshot: Snapshot, knobs: Knobs) -> None:
    views = list(snapshot.requests)
    assert vlt_scores(views, snapshot.t_now_s, knobs) == [
        vlt(v, snapshot.t_now_s, knobs) for v in views
    ]
    _, candidates, scores, _, _ = _classify(snapshot, knobs)  # LVF's inlined copy
    assert scores == [vlt(v, snapshot.t_now_s, knobs) for v in candidates]
    for view in views:
        score = vlt(view, snapshot.t_now_s, knobs)
        assert score <= 0 if view.state is RequestState.RUNNING else score >= 0
