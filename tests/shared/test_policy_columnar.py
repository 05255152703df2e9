"""LVF over columns (shared/policy/lvf.py) makes the same plans with and without the wire in
between, cut into scan segments or not; its building blocks agree with their
one-request-at-a-time references (tests/shared/policy_reference.py)."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import replace
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.policy_speed import make_snapshot
from shared.policy import (
    Knobs,
    Plan,
    RequestState,
    RequestView,
    Snapshot,
    columnar_from_snapshot,
    columns_from_views,
    make_plan,
)
from shared.policy import lvf as lvf_module
from shared.policy.columns import ColumnarSnapshot, HandleIds, pick_ids, views_from_columns
from shared.policy.lvf import lvf, lvf_transitions
from shared.policy.packing import greedy_take, pack_columns
from shared.policy.vlt import vlt_array
from shared.protocol import StateSnapshot, decode, encode
from shared.protocol.convert import columns_from_table, table_from_columns
from tests.shared.policy_reference import pack_schedule, snapshot_vlt, vlt
from tests.shared.test_policy_properties import knobs_strategy, snapshots

STATES = (RequestState.RUNNING, RequestState.WAITING, RequestState.ROTARY)


def random_snapshot(seed: int) -> tuple[Snapshot, Knobs]:
    """Up to 400 requests with many ties (times on a coarse grid), tight budgets, requests
    whose copies are in flight, little DRAM: every branch of LVF, at sizes where the columnar
    code takes its vectorised paths."""
    rng = random.Random(seed)
    bs = rng.choice((1, 4, 16))
    grid = rng.choice((0.0, 0.25, 1.0))
    t_now = 50.0

    def t(lo: float) -> float:
        value = rng.uniform(lo, t_now)
        return round(value / grid) * grid if grid else value

    num = rng.choice((1, 5, 40, 150, 400, 1200))
    views = [_random_view(rng, i, bs, t) for i in range(num)]
    num_running = sum(v.state is RequestState.RUNNING for v in views)
    scale = max(1, len(views))
    snapshot = Snapshot(
        t_now_s=t_now,
        requests=tuple(views),
        num_free_hbm_blocks=rng.randint(0, 4 * scale),
        num_free_dram_blocks=rng.choice((0, rng.randint(0, 8 * scale))),
        block_size=bs,
        max_num_batched_tokens=rng.choice((1, 64, rng.randint(1, 40 * scale))),
        max_num_seqs=rng.randint(max(1, num_running), num_running + scale),
        b_xfer_blocks=rng.randint(0, 10 * scale),
    )
    knobs = Knobs(
        policy="lvf",
        alpha=rng.choice((0.0, 1.0, rng.uniform(0, 5))),
        beta_b=rng.uniform(-2, 2),
        beta_f=rng.choice((0.0, 0.5, rng.uniform(0, 2))),
        slo_ttft_s=rng.uniform(0.5, 10),
        slo_tbt_s=rng.uniform(0.01, 1),
        min_residency_s=rng.choice((0.0, 0.0, rng.uniform(0, 3))),
    )
    return snapshot, knobs


def _random_view(rng: random.Random, index: int, bs: int, t) -> RequestView:
    state = rng.choice(STATES)
    num_tokens = rng.randint(1, 120)
    view = RequestView(
        request_id=f"r{index}",
        state=state,
        t_arr_s=t(0.0),
        num_tokens=num_tokens,
        priority=rng.randint(0, 2),
        arrival_seq=rng.randint(0, 5) if rng.random() < 0.3 else index,
        slo_ttft_s=rng.choice((None, rng.uniform(0.5, 20))),
        slo_tbt_s=rng.choice((None, rng.uniform(0.01, 1))),
    )
    if state is RequestState.WAITING:
        return view
    blocks = -(-(num_tokens - 1) // bs)
    if state is RequestState.ROTARY:
        return view._replace(
            num_computed_tokens=num_tokens - 1,
            num_blocks_hbm=rng.choice((0, 0, 0, 1)),
            num_blocks_dram=blocks,
            t_last_s=rng.choice((None, t(view.t_arr_s))),
        )
    computed = rng.choice((num_tokens - 1, rng.randint(0, num_tokens)))
    held = -(-computed // bs) + rng.randint(0, 1)
    return view._replace(
        num_computed_tokens=computed,
        num_blocks_hbm=held,
        num_blocks_dram=rng.randint(0, held),
        t_run_s=rng.choice((None, t(view.t_arr_s))),
        t_last_s=rng.choice((None, t(view.t_arr_s))),
        resident=rng.random() > 0.1,
    )


def through_the_wire(snapshot: Snapshot) -> ColumnarSnapshot:
    """What the control plane plans on: the worker's snapshot packed, encoded, decoded (each
    request known by its handle, arrival_seq, as the id)."""
    table = table_from_columns(columns_from_views(snapshot.requests))
    msg = StateSnapshot(
        "w", "e", 1, snapshot.t_now_s, table, snapshot.num_free_hbm_blocks,
        snapshot.num_free_dram_blocks, 0, 0, snapshot.block_size, 1,
        snapshot.max_num_batched_tokens, snapshot.max_num_seqs, snapshot.b_xfer_blocks,
        0.05, 0.0, "local",
    )  # fmt: skip
    decoded = decode(encode(msg), StateSnapshot)
    return replace(columnar_from_snapshot(snapshot), requests=columns_from_table(decoded.requests))


@settings(max_examples=1000, deadline=None)
@given(snapshot=snapshots(), knobs=knobs_strategy)
def test_lvf_plans_views_and_columns_alike(snapshot: Snapshot, knobs: Knobs) -> None:
    knobs = replace(knobs, policy="lvf")
    assert lvf(columnar_from_snapshot(snapshot), knobs) == lvf(snapshot, knobs)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), segment=st.sampled_from((1, 3, 256)))
def test_lvf_plans_alike_through_the_wire_and_in_scan_segments(seed: int, segment: int) -> None:
    snapshot, knobs = random_snapshot(seed)
    expected = lvf(snapshot, knobs)
    unique = with_unique_seqs(snapshot)
    unique_plan = by_handle(lvf(unique, knobs), unique)
    with patch.object(lvf_module, "_SEGMENT", segment):  # small: every scan is cut
        assert lvf(columnar_from_snapshot(snapshot), knobs) == expected
        assert lvf(through_the_wire(unique), knobs) == unique_plan
        moves = lvf_transitions(columnar_from_snapshot(snapshot), knobs)
    ids = [view.request_id for view in snapshot.requests]
    assert [ids[row] for row in moves.admit] == expected.admit_ids
    assert [ids[row] for row in moves.resume] == expected.resume_ids
    assert [ids[row] for row in moves.rotate_out] == expected.rotate_out_ids
    assert [ids[row] for row in moves.preempt] == expected.preempt_ids
    assert [(ids[row], n) for row, n in zip(moves.batch, moves.tokens, strict=True)] == [
        (chunk.request_id, chunk.num_tokens) for chunk in expected.schedule
    ]
    assert moves.fcfs_fallback == expected.fcfs_fallback
    lean = lvf_transitions(columnar_from_snapshot(snapshot), knobs, with_batch=False)
    for name in ("preempt", "rotate_out", "resume", "admit"):  # the control plane's call
        assert getattr(lean, name).tolist() == getattr(moves, name).tolist()


def with_unique_seqs(snapshot: Snapshot) -> Snapshot:
    """``snapshot`` with arrival_seqs made unique (a worker's are) in the same order: ties
    were broken by snapshot order, so the rank of (seq, position) keeps every decision."""
    order = sorted(range(len(snapshot.requests)), key=lambda i: snapshot.requests[i].arrival_seq)
    rank = {index: position for position, index in enumerate(order)}
    views = [view._replace(arrival_seq=rank[i]) for i, view in enumerate(snapshot.requests)]
    return replace(snapshot, requests=tuple(views))


def by_handle(plan: Plan, snapshot: Snapshot) -> Plan:
    """``plan`` with every request id replaced by its handle in decimal (HandleIds)."""
    handle = {view.request_id: str(view.arrival_seq) for view in snapshot.requests}
    return replace(
        plan,
        schedule=[chunk._replace(request_id=handle[chunk.request_id]) for chunk in plan.schedule],
        admit_ids=[handle[i] for i in plan.admit_ids],
        resume_ids=[handle[i] for i in plan.resume_ids],
        rotate_out_ids=[handle[i] for i in plan.rotate_out_ids],
        preempt_ids=[handle[i] for i in plan.preempt_ids],
    )


@pytest.mark.parametrize("size", [256, 1024, 4096])
def test_lvf_rotates_on_the_benchmark_snapshots(size: int) -> None:
    knobs = Knobs(policy="lvf")
    for seed in range(2):
        snapshot = make_snapshot(size, seed)
        plan = make_plan(columnar_from_snapshot(snapshot), knobs)
        assert plan == lvf(snapshot, knobs) and plan.rotate_out_ids


def test_other_policies_plan_a_columnar_snapshot_through_views() -> None:
    snapshot, _ = random_snapshot(7)
    for name in ("vllm", "vllm-priority", "swap", "edf"):
        knobs = Knobs(policy=name)
        assert make_plan(columnar_from_snapshot(snapshot), knobs) == make_plan(snapshot, knobs)


@settings(max_examples=300, deadline=None)
@given(snapshot=snapshots(), knobs=knobs_strategy)
def test_vlt_array_is_vlt_bit_for_bit(snapshot: Snapshot, knobs: Knobs) -> None:
    columns = columns_from_views(snapshot.requests)
    scores = vlt_array(columns, snapshot.t_now_s, knobs).tolist()
    assert scores == [snapshot_vlt(v, snapshot, knobs) for v in snapshot.requests]


@settings(max_examples=200, deadline=None)
@given(snapshot=snapshots())
def test_views_round_trip_through_columns(snapshot: Snapshot) -> None:
    views = tuple(v._replace(t_arr_s=float(v.t_arr_s)) for v in snapshot.requests)
    assert views_from_columns(columns_from_views(views)) == views
    by_handle = tuple(v._replace(request_id=str(v.arrival_seq)) for v in views)
    assert views_from_columns(through_the_wire(snapshot).requests) == by_handle


def _scan(sizes: list[int], budget: int, max_items: int, stop_at_zero: bool) -> list[int]:
    taken = []
    for position, size in enumerate(sizes):
        if max_items <= 0 or (stop_at_zero and budget <= 0):
            break
        if size <= budget:
            taken.append(position)
            budget -= size
            max_items -= 1
    return taken


@settings(max_examples=500, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), max_size=300),
    budget=st.integers(-5, 400),
    max_items=st.integers(0, 300),
    stop_at_zero=st.booleans(),
)
def test_greedy_take_is_the_sequential_scan(
    sizes: list[int], budget: int, max_items: int, stop_at_zero: bool
) -> None:
    taken, left = greedy_take(np.array(sizes, np.int64), budget, max_items, stop_at_zero)
    expected = _scan(sizes, budget, max_items, stop_at_zero)
    assert taken.tolist() == expected
    assert left == budget - sum(sizes[i] for i in expected)


def test_greedy_take_alternating_sizes_fall_back_to_the_scan() -> None:
    sizes = [1, 1000 - 1] * 200  # every round takes one item and skips one
    taken, left = greedy_take(np.array(sizes, np.int64), 998, 10**6, True)
    expected = _scan(sizes, 998, 10**6, True)
    assert taken.tolist() == expected and left == 998 - sum(sizes[i] for i in expected)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_free=st.integers(0, 60))
def test_pack_columns_is_pack_schedule(seed: int, num_free: int) -> None:
    snapshot, _ = random_snapshot(seed)
    rng = random.Random(seed)
    views = [v for v in snapshot.requests if rng.random() < 0.7]
    rng.shuffle(views)
    positions = {v.request_id: i for i, v in enumerate(snapshot.requests)}
    columns = columns_from_views(snapshot.requests)
    order = np.array([positions[v.request_id] for v in views], dtype=np.int64)
    batch, tokens = pack_columns(
        columns,
        order,
        snapshot.block_size,
        snapshot.max_num_batched_tokens,
        snapshot.max_num_seqs,
        num_free,
    )
    chunks = pack_schedule(views, snapshot, num_free)
    ids = [columns.request_ids[i] for i in batch.tolist()]
    assert list(zip(ids, tokens, strict=True)) == [(c.request_id, c.num_tokens) for c in chunks]


def test_negative_free_dram_only_lets_surplus_victims_rotate() -> None:
    snapshot, knobs = random_snapshot(11)
    for free_dram in (-1, -3):
        odd = replace(snapshot, num_free_dram_blocks=free_dram)
        plan = lvf(odd, knobs)
        leaving = {v.request_id: v for v in odd.requests if v.request_id in plan.rotate_out_ids}
        assert all(v.num_blocks_dram - v.num_blocks_hbm >= -free_dram for v in leaving.values())


def test_nan_marks_an_unknown_time() -> None:
    view = RequestView("r", RequestState.ROTARY, t_arr_s=8.0, num_tokens=4)
    columns = columns_from_views([view])
    assert math.isnan(columns.t_last_s[0]) and math.isnan(columns.t_run_s[0])
    assert vlt_array(columns, 10.0, Knobs()).tolist() == [vlt(view, 10.0, Knobs())]


def test_handle_ids_name_requests_by_arrival_seq() -> None:
    handles = HandleIds(np.array([7, 0, 2**40], np.int64))
    assert (
        list(handles) == ["7", "0", str(2**40)]
        and len(handles) == 3
        and handles[2] == "1099511627776"
    )
    assert pick_ids(handles, np.array([2, 0])) == [str(2**40), "7"]
    assert pick_ids(handles, np.array([], np.int64)) == []
    ids = ["a", "", "ünï", "req-42"]
    assert pick_ids(ids, np.array([3, 0])) == ["req-42", "a"]
    assert pick_ids(ids, np.array([2])) == ["ünï"]


@pytest.mark.parametrize("policy", ["lvf", "vllm", "edf"])
def test_plan_handles_are_the_plans_transitions(policy: str) -> None:
    """The control plane's door gives make_plan's transitions, named by arrival_seq."""
    from shared.policy import plan_handles

    for seed in range(20):
        views, knobs = random_snapshot(seed)
        snapshot = columnar_from_snapshot(views)
        knobs = dataclasses.replace(knobs, policy=policy)
        plan = make_plan(snapshot, knobs)
        handles = plan_handles(snapshot, knobs)
        columns = snapshot.requests
        seq_of = dict(zip(columns.request_ids, columns.arrival_seq.tolist(), strict=True))
        for ids, got in (
            (plan.admit_ids, handles.admit),
            (plan.resume_ids, handles.resume),
            (plan.rotate_out_ids, handles.rotate_out),
            (plan.preempt_ids, handles.preempt),
        ):
            assert sorted(seq_of[i] for i in ids) == sorted(got)
        assert handles.fcfs_fallback == plan.fcfs_fallback
