"""B_xfer has one writer: before each step the worker sets the budget once, from the plan that
step runs (data_plane/service.py ``Worker._set_b_xfer`` with the planner's ``remote_for``): a
fresh remote plan's budget, else the locally resolved one; a stale plan, or one made with
other knobs than the worker holds, never sets it."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

from data_plane.planner import HybridPlanner
from data_plane.service import Worker
from shared.policy import Knobs
from shared.protocol import RotationPlan

LOCAL_BUDGET = 48  # the knobs' fixed B_xfer, what a local step runs with


def _plan(snapshot_iteration: int, b_xfer_blocks: int, knobs_version: int = 1) -> RotationPlan:
    return RotationPlan(
        "w0", "e1", snapshot_iteration, knobs_version, "lvf", [], [], [], [], False, 0.0,
        b_xfer_blocks,
    )  # fmt: skip


def _worker(planner: HybridPlanner, iterations_done: int) -> SimpleNamespace:
    budgets: list[int] = []
    kv = SimpleNamespace(link_bytes_per_s=0.0, b_xfer_blocks=7, set_b_xfer_blocks=budgets.append)
    engine = SimpleNamespace(kv=kv, stats=SimpleNamespace(num_iterations=iterations_done))
    return SimpleNamespace(
        engine=engine, planner=planner, block_bytes=64, _iteration_time_s=0.01, budgets=budgets
    )


def test_the_step_runs_with_the_budget_of_the_plan_it_executes() -> None:
    planner = HybridPlanner(Knobs(policy="lvf", b_xfer=LOCAL_BUDGET), 4, "e1")
    planner.use_knobs(planner.knobs, 1)
    worker = _worker(planner, iterations_done=10)  # the next step is iteration 11
    set_b_xfer = partial(Worker._set_b_xfer, worker)  # type: ignore[arg-type]
    set_b_xfer()
    assert worker.budgets == [LOCAL_BUDGET]  # no plan: local
    assert planner.offer(_plan(9, 500))  # fresh for iteration 11
    set_b_xfer()
    assert worker.budgets[-1] == 500
    worker.engine.stats.num_iterations = 13  # iteration 14: 5 past the plan, stale
    set_b_xfer()
    assert worker.budgets[-1] == LOCAL_BUDGET
    assert planner.offer(_plan(12, 900))  # kept (the newest), but already stale for 17
    worker.engine.stats.num_iterations = 16
    set_b_xfer()
    assert worker.budgets[-1] == LOCAL_BUDGET


def test_a_plan_made_with_other_knobs_is_refused() -> None:
    planner = HybridPlanner(Knobs(policy="lvf", b_xfer=LOCAL_BUDGET), 4, "e1")
    planner.use_knobs(planner.knobs, 2)
    worker = _worker(planner, iterations_done=10)
    assert not planner.offer(_plan(10, 500, knobs_version=1))
    Worker._set_b_xfer(worker)  # type: ignore[arg-type]
    assert worker.budgets == [LOCAL_BUDGET] and planner.remote is None
    assert planner.offer(_plan(10, 500, knobs_version=2))
    planner.use_knobs(Knobs(policy="vllm", b_xfer=LOCAL_BUDGET), 3)  # new knobs: plan dropped
    Worker._set_b_xfer(worker)  # type: ignore[arg-type]
    assert worker.budgets[-1] == LOCAL_BUDGET and planner.remote is None
