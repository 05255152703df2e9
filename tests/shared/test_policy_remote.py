"""fit_plan: a plan from the control plane names requests by handle (arrival_seq); the worker
keeps the transitions that still apply to its current snapshot and maps them to its ids."""

from __future__ import annotations

from shared.policy.remote import fit_plan
from tests.shared.policy_views import T_NOW, rotary, running, snap, waiting


def test_handles_map_to_the_requests_they_name() -> None:
    snapshot = snap(
        running("run-a", t_run=1.0, seq=10),
        running("run-b", t_run=2.0, seq=11),
        rotary("rot-c", t_last=T_NOW - 1, seq=12),
        waiting("wait-d", t_arr=3.0, seq=13),
        free=100,
    )
    plan = fit_plan(snapshot, [13], [12], [11], [10])
    assert plan.preempt_ids == ["run-a"] and plan.rotate_out_ids == ["run-b"]
    assert plan.resume_ids == ["rot-c"] and plan.admit_ids == ["wait-d"]
    # the resumed request's KV is on its way back: it computes from the next iteration
    assert [chunk.request_id for chunk in plan.schedule] == ["wait-d"]


def test_stale_unknown_and_repeated_handles_are_dropped() -> None:
    snapshot = snap(
        running("run-a", t_run=1.0, seq=10),
        rotary("rot-c", t_last=T_NOW - 1, seq=12),
        waiting("wait-d", t_arr=3.0, seq=13),
        free=100,
    )
    # 10 is running (not waiting), 99 is gone, 12 is named twice: rotated out, then resumed
    plan = fit_plan(snapshot, [10, 99, 13, 13], [12, 10], [99, 12], [])
    assert plan.admit_ids == ["wait-d"] and plan.resume_ids == ["rot-c"]
    assert plan.rotate_out_ids == [] and plan.preempt_ids == []


def test_joining_requests_are_capped_by_max_num_seqs() -> None:
    snapshot = snap(
        running("run-a", t_run=1.0, seq=1),
        rotary("rot-b", t_last=T_NOW - 1, seq=2),
        waiting("wait-c", t_arr=3.0, seq=3),
        waiting("wait-d", t_arr=4.0, seq=4),
        free=100,
        seqs=3,
    )
    plan = fit_plan(snapshot, [4, 3], [2], [], [])
    assert plan.resume_ids == ["rot-b"] and plan.admit_ids == ["wait-d"]


def test_an_empty_plan_still_packs_the_running_batch() -> None:
    snapshot = snap(running("run-a", t_run=1.0, seq=1), free=100)
    plan = fit_plan(snapshot, [], [], [], [])
    assert [chunk.request_id for chunk in plan.schedule] == ["run-a"]
    assert not (plan.admit_ids or plan.resume_ids or plan.rotate_out_ids or plan.preempt_ids)
