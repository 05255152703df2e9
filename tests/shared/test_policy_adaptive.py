"""LVF's adaptive residency (shared/policy/adaptive.py): what it measures, how it moves, and
that it changes nothing unless LVF runs with ``adaptive_residency``."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from data_plane.planner import HybridPlanner
from shared.policy import Knobs
from shared.policy.adaptive import (
    OVERDUE_CAP,
    ResidencyController,
    controlled_knobs,
    overdue_now,
    residency_controller,
    residency_knobs,
)
from shared.policy.columns import columnar_from_snapshot
from tests.shared.policy_views import BS, rotary, running, snap, waiting

ADAPTIVE = Knobs(policy="lvf", adaptive_residency=True, slo_tbt_s=0.1)


def _late(t_now: float, gap_s: float):  # type: ignore[no-untyped-def]
    """Two started requests: one just decoded, one rotary ``gap_s`` since its last token."""
    return snap(
        running("a", t_run=t_now - 5, t_last=t_now),
        rotary("b", t_last=t_now - gap_s, slo_tbt=0.1),
        waiting("w", t_arr=t_now - 1),  # not started: never counted
        free=100,
        t_now=t_now,
    )


def test_overdue_is_the_mean_lateness_of_started_requests_in_tbt_objectives() -> None:
    snapshot = columnar_from_snapshot(_late(10.0, 0.6))  # b: 0.6 s = 6 objectives, 5 late
    assert overdue_now(snapshot, 0.1) == pytest.approx(5.0 / 2)
    capped = columnar_from_snapshot(_late(10.0, 1000.0))
    assert overdue_now(capped, 0.1) == pytest.approx(OVERDUE_CAP / 2)
    nobody = columnar_from_snapshot(snap(waiting("w", t_arr=9.0), free=10))
    assert overdue_now(nobody, 0.1) == 0.0


def test_sustained_lateness_doubles_the_residency_up_to_its_cap() -> None:
    controller = ResidencyController(value_s=0.5, max_s=4.0)
    values = []
    for step in range(200):  # 20 s of 0.1-s iterations, a request always 5 objectives late
        t_now = 10.0 + 0.1 * step
        values.append(controller.observe(columnar_from_snapshot(_late(t_now, 0.6)), 0.1))
    assert values[0] == 0.5  # no decision before a whole period
    assert max(values) == 4.0 and values[-1] == 4.0
    assert all(b in (a, min(4.0, 2 * a)) for a, b in itertools.pairwise(values))


def test_punctual_decoding_lowers_it_to_its_floor() -> None:
    controller = ResidencyController(value_s=2.0, min_s=0.25)
    for step in range(300):
        t_now = 10.0 + 0.1 * step
        controller.observe(columnar_from_snapshot(_late(t_now, 0.05)), 0.1)
    assert controller.value_s == 0.25


def test_an_engines_controller_never_goes_below_the_knob() -> None:
    knobs = dataclasses.replace(ADAPTIVE, min_residency_s=2.0)
    controller = residency_controller(knobs)
    assert controller.value_s == 2.0
    for step in range(300):  # punctual decoding: it would fall, but not below the knob
        controller.observe(columnar_from_snapshot(_late(10.0 + 0.1 * step, 0.05)), 0.1)
    assert controller.value_s == 2.0
    for step in range(300, 400):  # sustained lateness raises it to its ceiling
        controller.observe(columnar_from_snapshot(_late(10.0 + 0.1 * step, 0.6)), 0.1)
    assert controller.value_s == 8.0
    assert residency_controller(dataclasses.replace(knobs, min_residency_s=20.0)).max_s == 20.0


def test_a_floor_of_zero_still_rises_under_lateness() -> None:
    """``min_residency_s`` 0 is a floor, not "off": doubling 0 would stay 0 forever."""
    controller = residency_controller(dataclasses.replace(ADAPTIVE, min_residency_s=0.0))
    assert controller.value_s == 0.0
    for step in range(100):
        controller.observe(columnar_from_snapshot(_late(10.0 + 0.1 * step, 0.6)), 0.1)
    assert controller.value_s == 8.0


def test_knobs_change_only_for_adaptive_lvf() -> None:
    snapshot = _late(10.0, 0.6)
    for knobs in (
        Knobs(policy="vllm", adaptive_residency=True),
        Knobs(policy="lvf", adaptive_residency=False),
    ):
        assert controlled_knobs(snapshot, knobs, ResidencyController()) == (snapshot, knobs)
    controller = ResidencyController(value_s=1.25)
    columns, knobs = controlled_knobs(snapshot, ADAPTIVE, controller)
    assert knobs == dataclasses.replace(ADAPTIVE, min_residency_s=1.25)
    assert len(columns.requests) == 3


def test_the_worker_planner_feeds_it_and_a_new_residency_knob_restarts_it() -> None:
    planner = HybridPlanner(ADAPTIVE, max_age_iterations=4, epoch="e")
    for step in range(40):
        planner(_late(10.0 + 0.1 * step, 0.6))
    assert planner.residency.value_s > ADAPTIVE.min_residency_s
    planner.knobs = dataclasses.replace(ADAPTIVE, alpha=2.0)  # residency unchanged: kept
    assert planner.residency.value_s > ADAPTIVE.min_residency_s
    planner.knobs = dataclasses.replace(ADAPTIVE, min_residency_s=0.3)
    assert planner.residency.value_s == 0.3
    for step in range(40, 80):
        planner(_late(10.0 + 0.1 * step, 0.6))
    assert planner.residency.value_s > 0.3
    pinned = dataclasses.replace(ADAPTIVE, min_residency_s=0.3, adaptive_residency=False)
    planner.knobs = pinned  # off and on again: it restarts at the knob, not where it was
    planner.knobs = dataclasses.replace(pinned, adaptive_residency=True)
    assert planner.residency.value_s == 0.3


def test_the_peers_policies_never_follow_a_remote_plan() -> None:
    """A remote plan is fitted with LVF's joining rules: under vllm the worker plans alone."""
    from shared.protocol import RotationPlan

    planner = HybridPlanner(Knobs(policy="vllm"), max_age_iterations=4, epoch="e")
    # 6 blocks of prompt, 2 free: the first chunk (2 blocks' tokens) fits, the whole KV not
    snapshot = snap(waiting("w", t_arr=9.0, blocks=6), free=2, budget=2 * BS, t_now=10.0)
    remote = RotationPlan("w0", "e", 0, 0, "vllm", [], [], [], [], False, 0.0, 8)
    assert planner.offer(remote)
    plan = planner(snapshot)
    assert planner.source == "local" and planner.num_remote == 0
    assert plan.admit_ids == ["w"]  # vLLM admits on its first chunk's blocks, not its whole KV


def test_a_workers_residency_is_planned_with_only_under_adaptive_lvf() -> None:
    assert residency_knobs(ADAPTIVE, 1.25) == dataclasses.replace(ADAPTIVE, min_residency_s=1.25)
    assert residency_knobs(ADAPTIVE, None) == ADAPTIVE  # the sender keeps none: the knob's
    for knobs in (
        Knobs(policy="vllm", adaptive_residency=True),
        Knobs(policy="lvf", adaptive_residency=False),
    ):
        assert residency_knobs(knobs, 1.25) == knobs


def test_operators_see_the_value_planned_with_and_can_pin_it() -> None:
    planner = HybridPlanner(ADAPTIVE, max_age_iterations=4, epoch="e")
    for step in range(40):
        planner(_late(10.0 + 0.1 * step, 0.6))
    assert planner.min_residency_s == planner.residency.value_s > ADAPTIVE.min_residency_s
    pinned = dataclasses.replace(ADAPTIVE, adaptive_residency=False, min_residency_s=0.7)
    planner.knobs = pinned
    for step in range(40, 80):
        planner(_late(10.0 + 0.1 * step, 0.6))
    assert planner.min_residency_s == 0.7
