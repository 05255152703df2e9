"""fit_plan: a plan from the control plane names requests by handle (arrival_seq); the worker
keeps the transitions that still apply to its current snapshot and maps them to its ids."""

from __future__ import annotations

from shared.policy import RequestState, RequestView
from shared.policy.remote import fit_plan
from tests.shared.policy_views import BS, T_NOW, ids, rotary, running, snap, waiting


def test_handles_map_to_the_requests_they_name() -> None:
    snapshot = snap(
        running("run-a", t_run=1.0, seq=10),
        running("run-b", t_run=2.0, seq=11),
        rotary("rot-c", t_last=T_NOW - 1, seq=12),
        waiting("wait-d", t_arr=3.0, seq=13),
        free=100,
    )
    plan = fit_plan(snapshot, [13], [12], [11], [])
    assert plan.rotate_out_ids == ["run-b"] and plan.preempt_ids == []
    assert plan.resume_ids == ["rot-c"] and plan.admit_ids == ["wait-d"]
    # the resumed request's KV is on its way back: it computes from the next iteration
    assert ids(plan.schedule) == ["run-a", "wait-d"]


def test_nobody_joins_in_a_step_that_preempts_by_recompute() -> None:
    """vLLM's rule, as LVF follows it: the blocks a recompute frees are the growth's."""
    snapshot = snap(
        running("run-a", t_run=1.0, seq=10),
        running("run-b", t_run=2.0, seq=11),
        rotary("rot-c", t_last=T_NOW - 1, seq=12),
        waiting("wait-d", t_arr=3.0, seq=13),
        free=100,
    )
    plan = fit_plan(snapshot, [13], [12], [11], [10])
    assert plan.preempt_ids == ["run-a"] and plan.rotate_out_ids == ["run-b"]
    assert plan.resume_ids == [] and plan.admit_ids == []


def test_no_admission_without_room_for_the_whole_kv() -> None:
    """4 free blocks, the running request grows by one: a 4-block prompt does not fit (it
    would be preempted by the growth a step later), a 3-block one does."""
    grower = RequestView(
        "run-a",
        RequestState.RUNNING,
        t_arr_s=0.0,
        num_tokens=2 * BS + 1,
        num_computed_tokens=2 * BS,
        num_blocks_hbm=2,
        t_run_s=1.0,
        t_last_s=T_NOW,
        arrival_seq=1,
    )
    snapshot = snap(
        grower,
        waiting("big", t_arr=2.0, blocks=4, seq=2),
        waiting("small", t_arr=3.0, blocks=3, seq=3),
        free=4,
    )
    plan = fit_plan(snapshot, [2, 3], [], [], [])
    assert plan.admit_ids == ["small"]
    assert ids(plan.schedule) == ["run-a", "small"]


def test_no_admission_without_a_chunk() -> None:
    """The token budget is spent by the running prefill: the admitted request would hold a
    seat with no KV, so it keeps waiting."""
    prefill = running("run-a", t_run=1.0, blocks=4, pending=40, seq=1)
    snapshot = snap(prefill, waiting("wait-b", t_arr=2.0, seq=2), free=100, budget=40)
    plan = fit_plan(snapshot, [2], [], [], [])
    assert plan.admit_ids == [] and ids(plan.schedule) == ["run-a"]


def test_a_victims_synced_blocks_seat_the_joining_request_in_the_same_step() -> None:
    """No free block, no free seat: the rotated-out victim's synced blocks (it has DRAM twins
    for all 4) and its seat go to the resumed request at once."""
    victim = running("run-a", t_run=1.0, blocks=4, dram=4, seq=1)
    snapshot = snap(victim, rotary("rot-b", t_last=T_NOW - 1, blocks=3, seq=2), free=0, seqs=1)
    plan = fit_plan(snapshot, [], [2], [1], [])
    assert plan.rotate_out_ids == ["run-a"] and plan.resume_ids == ["rot-b"]


def test_a_victim_dram_cannot_hold_stays_running() -> None:
    victim = running("run-a", t_run=1.0, blocks=4, dram=0, seq=1)
    snapshot = snap(victim, free=10, dram=3)
    plan = fit_plan(snapshot, [], [], [1], [])
    assert plan.rotate_out_ids == [] and ids(plan.schedule) == ["run-a"]


def test_a_victim_still_loading_stays_running() -> None:
    """Its KV is being copied in (a stale plan named it): parking it would free the HBM
    blocks its loads target, so it stays until resident."""
    loading = running("run-a", t_run=1.0, blocks=4, dram=4, resident=False, seq=1)
    plan = fit_plan(snap(loading, free=10, dram=10), [], [], [1], [])
    assert plan.rotate_out_ids == [] and plan.preempt_ids == []


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
