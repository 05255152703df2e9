"""LVF (SUPERINFER.md §4) on hand-built snapshots, step by step (VLT: test_policy_vlt.py).

Block size 16 throughout; times in seconds with t_now = 10 unless a test says otherwise.
"""

from __future__ import annotations

import dataclasses

import pytest

from shared.policy import (
    PAPER_LVF,
    Knobs,
    RequestState,
    RequestView,
    Snapshot,
    columnar_from_snapshot,
    make_plan,
)
from shared.policy.common import make_chunk
from shared.policy.types import ScheduledChunk
from tests.shared.policy_reference import pack_schedule, reference_growth
from tests.shared.policy_views import (
    BS,
    LVF,
    T_NOW,
    check_plan,
    ids,
    rotary,
    running,
    snap,
    waiting,
)

S4 = Knobs(policy="lvf", **PAPER_LVF)  # SUPERINFER.md §4 exactly: every extension off
BY_VLT = Knobs(policy="lvf", lag_per_block=False)  # the defaults, the head ranked by VLT as §4


def at_block_boundary(rid: str, blocks: int, t_last: float | None = None) -> RequestView:
    """A running request (since t = 1) whose ``blocks`` blocks are full: its next token
    needs one more block (growth 1)."""
    return RequestView(
        rid,
        RequestState.RUNNING,
        t_arr_s=0.0,
        num_tokens=blocks * BS + 1,
        num_computed_tokens=blocks * BS,
        num_blocks_hbm=blocks,
        t_run_s=1.0,
        t_last_s=t_last,
    )


def test_paper_lvf_is_every_extension_off() -> None:
    """§3's VLT across classes too: no deadline shift, no residency yielding to a class."""
    assert not S4.deadline_lag and not S4.residency_yields_to_tighter
    assert S4.min_residency_s == 0 and not (S4.rotate_only_for_lag or S4.tpot_lag)


def test_fcfs_fallback_seats_go_to_requests_that_can_start() -> None:
    """Without contention, a rotary request whose rotate-out copy is still in flight (it
    holds HBM blocks) cannot come back yet: the last free seat goes to the next in line."""
    leaving = rotary("leaving", t_last=4.0, seq=1)._replace(num_blocks_hbm=2)
    later = waiting("later", t_arr=6.0, seq=2)
    plan = make_plan(snap(leaving, later, free=50, seqs=1), S4)
    assert plan.fcfs_fallback and plan.admit_ids == ["later"] and not plan.resume_ids


def test_fcfs_fallback_when_free_hbm_after_growth_covers_waiting_and_rotary() -> None:
    # x decodes at a block boundary: its next token needs a new block (growth 1)
    x = at_block_boundary("x", 2)
    assert reference_growth(snap(x, free=0)) == {"x": 1}
    late = waiting("late", t_arr=5.0, blocks=3, seq=2)
    early = rotary("early", t_last=4.0, blocks=3, seq=1)
    enough = snap(x, late, early, free=7, xfer=100)  # 7 - 1 >= 3 + 3
    plan = make_plan(enough, LVF)
    assert plan.fcfs_fallback
    assert (plan.resume_ids, plan.admit_ids) == (["early"], ["late"])  # by arrival, not VLT
    assert not plan.rotate_out_ids and not plan.preempt_ids
    assert ids(plan.schedule) == ["x", "late"]  # "early" runs once its H2D copy is done
    check_plan(enough, plan)
    short = snap(x, late, early, free=6, xfer=100)  # growth counts: 6 - 1 < 6
    assert not make_plan(short, LVF).fcfs_fallback


def test_contention_check_is_exact_at_the_boundary() -> None:
    # 3 requests of 17 tokens: 51 tokens but 6 blocks (2 each)
    views = [waiting(f"w{i}", t_arr=float(i)) for i in range(3)]
    views = [RequestView(v.request_id, v.state, v.t_arr_s, num_tokens=BS + 1) for v in views]
    assert make_plan(snap(*views, free=6), LVF).fcfs_fallback
    assert not make_plan(snap(*views, free=5), LVF).fcfs_fallback
    assert not make_plan(snap(*views, free=3), LVF).fcfs_fallback
    assert make_plan(snap(free=0), LVF).fcfs_fallback  # nothing to wait for


def test_fcfs_fallback_respects_max_num_seqs() -> None:
    views = [running("x", t_run=1.0)] + [waiting(f"w{i}", t_arr=i, seq=i) for i in range(2)]
    snapshot = snap(*views, free=100, seqs=3)
    plan = make_plan(snapshot, LVF)
    assert plan.fcfs_fallback and plan.admit_ids == ["w0", "w1"]
    check_plan(snapshot, plan)


def test_seats_are_contended_like_blocks() -> None:
    """HBM for everyone, seats for fewer: LVF ranks by lag, and rotates a running request out
    for a seat. The contention check counted only blocks: at max_num_seqs a request waited
    however long, and more free HBM left it worse off than less (found by the policy review)."""
    views = [running("x", t_run=1.0)] + [waiting(f"w{i}", t_arr=i, seq=i) for i in range(4)]
    snapshot = snap(*views, free=100, seqs=3)
    plan = make_plan(snapshot, LVF)
    assert not plan.fcfs_fallback and plan.admit_ids == ["w0", "w1"]  # the largest VLTs
    check_plan(snapshot, plan)
    t_now = 200.0
    seated = [
        running(r, t_run=1.0, blocks=32, t_last=t_now - 0.01, seq=i) for i, r in enumerate("ab")
    ]
    late = waiting("late", t_arr=100.0, seq=2)
    for free in (1000, 1):  # plenty of HBM, or not enough: a seat is made either way
        full = snap(*seated, late, free=free, xfer=100, seqs=2, t_now=t_now)
        plan = make_plan(full, LVF)
        assert len(plan.rotate_out_ids) == 1, (free, plan)
        assert plan.admit_ids == (["late"] if free > 1 else []), plan  # 1: once b's blocks go
        check_plan(full, plan)


# ---- step 3: the head scan -----------------------------------------------------------------


def test_head_scan_skips_what_does_not_fit_and_keeps_scanning() -> None:
    a = waiting("a", t_arr=0.0, blocks=6)  # VLT 7.5
    b = waiting("b", t_arr=1.0, blocks=8)  # VLT 6.5: 8 > 4 left, skipped
    c = waiting("c", t_arr=2.0, blocks=3)  # VLT 5.5: fits in the 4 left
    d = waiting("d", t_arr=3.0, blocks=2)  # VLT 4.5: 2 > 1 left, skipped
    snapshot = snap(d, c, b, a, free=10)  # B_HBM 10 < 19: contention; B_left = 10 + 0
    plan = make_plan(snapshot, BY_VLT)
    assert not plan.fcfs_fallback
    assert plan.admit_ids == ["a", "c"]
    assert [(ch.request_id, ch.num_tokens) for ch in plan.schedule] == [("a", 96), ("c", 48)]
    assert not plan.rotate_out_ids  # B_swap = 0 - 1 < 0
    check_plan(snapshot, plan)


def test_head_scan_budget_is_b_hbm_plus_b_xfer_and_seats() -> None:
    """B_left = B_HBM + B_xfer: 2 free + 10 to move takes three 4-block requests; the tail
    pays the 10 beyond the free HBM (x, the longest running, holds 4 + y 4 + z 4 = 12)."""
    run = [running(n, t_run=float(i), blocks=4, seq=i, dram=4) for i, n in enumerate("xyz")]
    ranked = [waiting(f"w{i}", t_arr=float(i), blocks=4, seq=10 + i) for i in range(5)]
    snapshot = snap(*run, *ranked, free=2, xfer=10)
    plan = make_plan(snapshot, S4)
    assert plan.rotate_out_ids == ["x", "y", "z"]  # B_swap 10: 4, 4, then 2 more
    assert plan.admit_ids == ["w0", "w1", "w2"]  # their blocks are reused in this step
    check_plan(snapshot, plan)
    two_seats = snap(*ranked, free=2, xfer=10, seqs=2)  # nobody to rotate: two seats
    assert make_plan(two_seats, S4).admit_ids == []  # 2 free blocks hold no whole prompt
    short = snap(at_block_boundary("g", 4), *ranked, free=0, xfer=10)
    plan = make_plan(short, S4)  # growth ate all HBM: B_left = -1 + 10 takes w0 and w1
    assert plan.rotate_out_ids == ["g"] and plan.admit_ids == []  # g frees 4 + 1 < 8


def test_waiting_and_rotary_compete_in_one_ranking() -> None:
    w = waiting("w", t_arr=0.0, blocks=3)  # VLT 7.5
    r_behind = rotary("r", t_last=7.0, blocks=3)  # VLT 3 * 3 = 9 > 7.5
    r_close = rotary("r", t_last=8.0, blocks=3)  # VLT 3 * 2 = 6 < 7.5
    for r, winner in ((r_behind, "r"), (r_close, "w")):
        for order in ((w, r), (r, w)):  # snapshot order does not matter
            plan = make_plan(snap(*order, free=4), LVF)  # room for one of them
            assert plan.resume_ids + plan.admit_ids == [winner]
    # alpha trades TBT for TTFT: with alpha 1 the same rotary request loses
    plan = make_plan(snap(w, r_behind, free=4), Knobs(policy="lvf", alpha=1.0))
    assert plan.admit_ids == ["w"] and plan.resume_ids == []


def test_equal_vlt_is_first_come_first_served() -> None:
    young = [waiting(f"w{i}", t_arr=9.0 + i / 10, seq=i) for i in (3, 1, 2)]  # all VLT 0
    plan = make_plan(snap(*young, free=4), LVF)
    assert plan.admit_ids == ["w1", "w2"]


def test_beta_f_tolerance_is_a_phase_change_for_young_waiting_requests() -> None:
    w = waiting("w", t_arr=7.0, blocks=2)  # 3 s old: VLT ReLU(3 - beta_F * 5)
    r = rotary("r", t_last=9.9, blocks=2)  # VLT 3 * 0.1 = 0.3
    assert make_plan(snap(w, r, free=2), LVF).admit_ids == ["w"]  # 0.5 > 0.3
    plan = make_plan(snap(w, r, free=2), Knobs(policy="lvf", beta_f=0.6))  # VLT(w) = 0
    assert plan.resume_ids == ["r"] and plan.admit_ids == []


def test_seats_are_a_budget_the_tail_can_pay() -> None:
    """At max_num_seqs a lagging request still gets in: the tail rotates out one victim per
    seat it owes (fix: the head scan used to be empty while victims still counted as
    seated). Without a transfer budget no seat is bought."""
    views = [running("x", t_run=8.0, seq=0, dram=2), running("y", t_run=9.0, seq=1, dram=2)]
    views += [waiting(f"w{i}", t_arr=float(i), blocks=1, seq=10 + i) for i in range(3)]
    full = snap(*views, free=2, seqs=2, xfer=10)  # 3 blocks wanted, 2 free: contention
    plan = make_plan(full, S4)
    assert plan.rotate_out_ids == ["x", "y"] and plan.admit_ids == ["w0", "w1"]
    check_plan(full, plan)
    assert make_plan(snap(*views, free=2, seqs=2), S4).admit_ids == []  # B_xfer 0
    one_free = snap(*views, free=2, seqs=3, xfer=10)
    plan = make_plan(one_free, S4)
    assert plan.rotate_out_ids == ["x", "y"] and plan.admit_ids == ["w0", "w1", "w2"]
    check_plan(one_free, plan)


def test_only_chosen_requests_that_can_act_now_change_state() -> None:
    # w0 and r are chosen (B_left = 2 + 10) but only 2 blocks are free now: r's H2D copy
    # would need 4, so it stays rotary; w0's whole KV (4 blocks) does not fit either, so it
    # keeps waiting rather than start a prefill the running requests' growth would preempt
    w0 = waiting("w0", t_arr=0.0, blocks=4)  # VLT 7.5
    r = rotary("r", t_last=8.0, blocks=4)  # VLT 6
    snapshot = snap(w0, r, free=2, xfer=10)
    plan = make_plan(snapshot, LVF)
    assert plan.admit_ids == [] and plan.resume_ids == [] and plan.schedule == []
    check_plan(snapshot, plan)
    # with 4 free blocks w0 starts (all 64 tokens fit); r, ranked below, waits for room
    roomier = snap(w0, r, free=4, xfer=10)
    plan = make_plan(roomier, LVF)
    assert plan.admit_ids == ["w0"] and plan.resume_ids == []
    assert [(c.request_id, c.num_tokens) for c in plan.schedule] == [("w0", 64)]
    check_plan(roomier, plan)
    assert make_plan(columnar_from_snapshot(roomier), LVF) == plan


def test_rotary_request_still_rotating_out_is_passed_over() -> None:
    evicting = RequestView(
        "r",
        RequestState.ROTARY,
        t_arr_s=0.0,
        num_tokens=2 * BS,
        num_computed_tokens=2 * BS - 1,
        num_blocks_hbm=1,  # its unsynced tail block is still being copied out
        num_blocks_dram=2,
        t_last_s=5.0,
    )  # VLT 15: the head of L, but it cannot come back before its D2H copy is done
    snapshot = snap(evicting, waiting("w", t_arr=0.0, blocks=2), free=2)
    plan = make_plan(snapshot, LVF)
    assert plan.resume_ids == [] and plan.admit_ids == ["w"]
    fcfs = make_plan(snap(evicting, free=10), LVF)
    assert fcfs.fcfs_fallback and fcfs.resume_ids == []


# ---- step 4: the tail scan -----------------------------------------------------------------


def tail_scenario(*, dram: int = 1000, xfer: int = 10) -> tuple[Snapshot, list[RequestView]]:
    """Three running requests of 4 blocks each (no growth), no free HBM, one lagging waiting
    request of 8 blocks: B_left = 0 + xfer - 8, B_swap = 8."""
    run = [running("x", t_run=0.0, blocks=4, seq=0), running("y", t_run=5.0, blocks=4, seq=1)]
    run.append(running("z", t_run=9.0, blocks=4, seq=2))
    return snap(*run, waiting("w", t_arr=0.0, blocks=8), free=0, xfer=xfer, dram=dram), run


def test_tail_scan_rotates_out_longest_running_while_b_swap_is_positive() -> None:
    snapshot, _ = tail_scenario()
    plan = make_plan(snapshot, LVF)
    assert plan.rotate_out_ids == ["x", "y"]  # VLT -10, -5; B_swap 8 -> 4 -> 0, z stays
    assert not plan.preempt_ids
    # w was chosen, but the rotated-out blocks are free only after their D2H copy
    assert plan.admit_ids == [] and ids(plan.schedule) == ["z"]
    check_plan(snapshot, plan)
    # next iteration: x and y are rotary (their VLT lags from their last token), 8 blocks free
    x_rot = rotary("x", t_last=T_NOW, blocks=4)
    y_rot = rotary("y", t_last=T_NOW, blocks=4)
    after = snap(
        running("z", t_run=7.0, blocks=4),  # resident 3.05 s: past the 2 s residency
        x_rot,
        y_rot,
        waiting("w", t_arr=0.0, blocks=8),
        free=8,
        xfer=10,
        t_now=T_NOW + 0.05,
    )
    plan = make_plan(after, LVF)
    # all three are chosen (B_left 18 - 16 = 2); w takes the 8 free blocks and is admitted, x
    # and y wait for room, and B_swap = 10 - 2 = 8 rotates z (VLT -3.05) out to make it
    assert plan.admit_ids == ["w"] and plan.resume_ids == [] and plan.rotate_out_ids == ["z"]
    assert plan.schedule == [ScheduledChunk("w", 128)]
    check_plan(after, plan)


def test_tail_scan_needs_b_swap() -> None:
    snapshot, _ = tail_scenario(xfer=8)  # B_left = 0, B_swap = 8
    assert make_plan(snapshot, LVF).rotate_out_ids == ["x", "y"]
    snapshot, _ = tail_scenario(xfer=20)  # B_left = 12, B_swap = 8: same
    assert make_plan(snapshot, LVF).rotate_out_ids == ["x", "y"]
    snapshot, _ = tail_scenario(xfer=4)  # w does not fit: B_left = 4, B_swap = 0
    plan = make_plan(snapshot, LVF)
    assert not plan.rotate_out_ids and not plan.preempt_ids and not plan.admit_ids


def test_tail_scan_stops_at_non_negative_vlt() -> None:
    run = [running("x", t_run=0.0, blocks=4), running("now", t_run=T_NOW, blocks=4)]
    snapshot = snap(*run, waiting("w", t_arr=0.0, blocks=8), free=0, xfer=8)  # B_swap 8
    plan = make_plan(snapshot, LVF)
    assert plan.rotate_out_ids == ["x"]  # "now" has VLT 0: not < 0


def test_tail_scan_passes_over_non_resident_and_blockless_requests() -> None:
    arriving = running("h2d", t_run=0.0, blocks=4, resident=False)  # just resumed
    empty = RequestView("empty", RequestState.RUNNING, t_arr_s=0.0, num_tokens=0, t_run_s=0.5)
    x = running("x", t_run=1.0, blocks=4)
    snapshot = snap(arriving, empty, x, waiting("w", t_arr=0.0, blocks=4), free=0, xfer=4)
    plan = make_plan(snapshot, LVF)
    assert plan.rotate_out_ids == ["x"]
    assert "h2d" not in ids(plan.schedule)  # not resident: not scheduled either
    check_plan(snapshot, plan)


def test_tail_scan_spares_requests_unserved_since_they_entered_running() -> None:
    # x was resumed at t=1 but its H2D copy kept it from running: no token since (t_last 0.5)
    x = running("x", t_run=1.0, blocks=4, t_last=0.5)
    fresh = running("fresh", t_run=2.0, blocks=4, t_last=None)  # admitted, prefill going on
    y = running("y", t_run=5.0, blocks=4)
    snapshot = snap(x, fresh, y, waiting("w", t_arr=0.0, blocks=8), free=0, xfer=8)
    plan = make_plan(snapshot, LVF)
    assert plan.rotate_out_ids == ["y"]  # B_swap 8 is left half covered rather than thrash
    # but a real shortage (running growth > free HBM) may take them: vLLM would preempt too
    x_full = at_block_boundary("x", 4, t_last=0.5)  # its next token needs a 5th block
    short = snap(x_full, fresh, free=0, xfer=0)  # B_HBM = -1, B_swap = 1
    assert make_plan(short, LVF).rotate_out_ids == ["x"]


def test_without_dram_room_proactive_victims_stay_running() -> None:
    snapshot, _ = tail_scenario(dram=0)
    plan = make_plan(snapshot, LVF)
    # HBM is not short for the running requests' growth: rotation is proactive, and with no
    # DRAM room it does not turn into recompute; x and y keep running, w keeps waiting
    assert plan.preempt_ids == [] and plan.rotate_out_ids == []
    assert plan.admit_ids == [] and ids(plan.schedule) == ["x", "y", "z"]
    check_plan(snapshot, plan)
    # a victim whose blocks are all synced to DRAM already needs no DRAM room
    run = [running("x", t_run=0.0, blocks=4, dram=4), running("y", t_run=5.0, blocks=4, dram=1)]
    synced = snap(*run, waiting("w", t_arr=0.0, blocks=8), free=0, xfer=8, dram=0)
    plan = make_plan(synced, LVF)
    assert (plan.rotate_out_ids, plan.preempt_ids) == (["x"], [])


def test_without_dram_room_a_real_hbm_shortage_preempts_the_newest_by_recompute() -> None:
    # x's next token needs a 5th block and HBM has none: B_HBM = -1, the shortage forces a
    # victim (x, the tail of L); DRAM has no room for it, so the shortage is covered as vLLM
    # covers it: the newest running request (y, last in the running list) is recomputed
    x_full = at_block_boundary("x", 4, t_last=2.0)
    y = running("y", t_run=5.0, blocks=4)
    short = snap(x_full, y, free=0, xfer=0, dram=0)
    plan = make_plan(short, LVF)
    assert plan.preempt_ids == ["y"] and plan.rotate_out_ids == []
    assert ids(plan.schedule) == ["x"]  # y's blocks are free at once: x gets its 5th block
    check_plan(short, plan)
    assert make_plan(columnar_from_snapshot(short), LVF) == plan
    # a request whose KV is still arriving (H2D in flight) frees nothing now: passed over
    arriving = running("z", t_run=6.0, blocks=4, resident=False)
    plan = make_plan(snap(x_full, y, arriving, free=0, xfer=0, dram=0), LVF)
    assert plan.preempt_ids == ["y"]


def test_equal_running_vlt_rotates_the_later_arrival_first() -> None:
    run = [running(f"x{i}", t_run=1.0, blocks=4, seq=i) for i in range(3)]
    snapshot = snap(*run, waiting("w", t_arr=0.0, blocks=4), free=0, xfer=4)
    assert make_plan(snapshot, LVF).rotate_out_ids == ["x2"]  # reversed L: last come first


# ---- packing the batch ----------------------------------------------------------------------


def test_schedule_decodes_first_then_chunks_within_budget_and_blocks() -> None:
    prefill = running("p", t_run=8.0, blocks=2, pending=100)
    d1, d2 = running("d1", t_run=9.0), running("d2", t_run=9.5)
    fresh = waiting("w", t_arr=0.0, blocks=8)  # does not fit in B_left = 7 - 4 (p's growth)
    snapshot = snap(prefill, d1, d2, fresh, free=7, budget=64)
    plan = make_plan(snapshot, LVF)
    assert [(c.request_id, c.num_tokens) for c in plan.schedule] == [
        ("d1", 1),
        ("d2", 1),
        ("p", 62),
    ]
    assert plan.num_scheduled_tokens == 64 and plan.admit_ids == []
    check_plan(snapshot, plan)


def test_chosen_waiting_request_without_a_chunk_keeps_waiting() -> None:
    d1, d2 = running("d1", t_run=9.0), running("d2", t_run=9.5)
    w = waiting("w", t_arr=0.0, blocks=3)  # chosen: fits in B_left = 3
    w_big = waiting("big", t_arr=1.0, blocks=5)  # does not: contention
    snapshot = snap(d1, d2, w, w_big, free=3, budget=2)  # the decodes take the whole budget
    plan = make_plan(snapshot, LVF)
    assert ids(plan.schedule) == ["d1", "d2"] and plan.admit_ids == []
    assert not plan.rotate_out_ids  # B_swap = 0 - 0
    plan = make_plan(snap(d1, d2, w, w_big, free=3, budget=50), LVF)
    assert plan.admit_ids == ["w"] and plan.schedule[-1] == ScheduledChunk("w", 48)


def test_pack_schedule_shrinks_prefill_to_free_blocks_and_skips_non_resident() -> None:
    p = waiting("p", t_arr=0.0, blocks=10)
    h2d = running("h2d", t_run=0.0, resident=False)
    snapshot = snap(h2d, p, free=3)
    assert pack_schedule([h2d, p], snapshot, 3) == [ScheduledChunk("p", 48)]
    assert pack_schedule([h2d, p], snapshot, 0) == []


def test_make_chunk_equals_the_dataclass() -> None:
    chunk = make_chunk("a", 3)
    assert chunk == ScheduledChunk("a", 3) and hash(chunk) == hash(ScheduledChunk("a", 3))
    with pytest.raises(AttributeError):
        chunk.num_tokens = 4  # type: ignore[misc]


def test_min_residency_spares_recently_resumed_requests() -> None:
    """The extension knob (0.5 s by default): the tail scan passes over running requests that
    became resident less than min_residency_s ago, and takes the older ones."""
    now = 100.0
    old = RequestView("old", RequestState.RUNNING, 0.0, 40, 40, 10, 0, t_run_s=now - 10,
                      t_last_s=now - 0.01)  # fmt: skip
    fresh = RequestView("fresh", RequestState.RUNNING, 1.0, 40, 40, 10, 0, t_run_s=now - 0.3,
                        t_last_s=now - 0.01)  # fmt: skip
    waiting = RequestView("w", RequestState.WAITING, now - 30, 200)
    snapshot = Snapshot(now, (old, fresh, waiting), 0, 100, 4, 64, 8, b_xfer_blocks=60)
    spared = make_plan(snapshot, Knobs(policy="lvf", min_residency_s=1.0))
    paper = make_plan(snapshot, S4)
    assert spared.rotate_out_ids == ["old"]
    assert make_plan(snapshot, Knobs(policy="lvf")).rotate_out_ids == ["old"]  # 0.3 s < 0.5
    assert paper.rotate_out_ids == ["old", "fresh"]


def test_a_rotary_request_waiting_for_room_holds_it_against_lower_ranks() -> None:
    # r lags most (VLT 3 x 9.5); its 8 blocks are within B_left (2 free + 10 budget) but not
    # within B_HBM: with DRAM full nothing rotates out, so r waits for room. w ranks below r
    # and would fit the 2 free blocks: it must not take them (else r never comes back)
    x = running("x", t_run=9.0, blocks=4, t_last=9.9)
    r = rotary("r", t_last=0.5, blocks=8, seq=1)
    w = waiting("w", t_arr=0.0, blocks=2, seq=2)
    snapshot = snap(x, r, w, free=2, xfer=10, dram=0)
    plan = make_plan(snapshot, BY_VLT)
    assert not plan.fcfs_fallback
    assert plan.resume_ids == [] and plan.admit_ids == [] and plan.rotate_out_ids == []
    assert ids(plan.schedule) == ["x"]
    check_plan(snapshot, plan)
    assert make_plan(columnar_from_snapshot(snapshot), BY_VLT) == plan  # the numpy LVF agrees
    # with room for r, r comes back and w (ranked below, fitting what is left) joins too
    roomy = snap(x, r, w, free=11, xfer=10, dram=0)
    plan = make_plan(roomy, BY_VLT)
    assert plan.resume_ids == ["r"] and plan.admit_ids == ["w"]
    check_plan(roomy, plan)


def test_deadline_lag_lets_a_tight_class_go_before_an_older_loose_one() -> None:
    """Room for one 3-block prompt: §3's lag in seconds takes the 25 s old batch request (10 s
    past its 15 s tolerance), deadline_lag the 1.5 s old interactive one (deadline in 0.5 s)."""
    batch = waiting("batch", t_arr=T_NOW - 25.0, blocks=3, slo_ttft=30.0)
    interactive = waiting("interactive", t_arr=T_NOW - 1.5, blocks=3, seq=1, slo_ttft=2.0)
    snapshot = snap(batch, interactive, free=4)
    assert make_plan(snapshot, Knobs(policy="lvf", deadline_lag=False)).admit_ids == ["batch"]
    assert make_plan(snapshot, LVF).admit_ids == ["interactive"]


def test_late_requests_go_after_those_that_can_still_make_it_within_free_hbm() -> None:
    """demote_late_s 0: a request past its TTFT ranks after every one that can still make it
    (even one not lagging, though it lags more) and never makes room by rotation; off, it
    ranks first."""
    late = waiting("late", t_arr=T_NOW - 8.0, blocks=3, slo_ttft=2.0)  # missed by 6 s
    on_time = waiting("on_time", t_arr=T_NOW - 4.0, blocks=3, seq=1)  # S_F 5: 1.5 s lag
    demote = Knobs(policy="lvf", demote_late_s=0.0)
    assert make_plan(snap(late, on_time, free=4), LVF).admit_ids == ["late"]
    assert make_plan(snap(late, on_time, free=4), demote).admit_ids == ["on_time"]
    both = snap(late, on_time, waiting("w", t_arr=T_NOW, blocks=2, seq=2), free=7)
    assert make_plan(both, demote).admit_ids == ["on_time", "w"]  # after w (VLT 0) too
    victim = running("x", t_run=0.0, blocks=4, dram=4)
    rotating = snap(victim, late, free=0, xfer=8)
    assert make_plan(rotating, LVF).rotate_out_ids == ["x"]  # the late request lags: room
    plan = make_plan(rotating, demote)
    assert plan.rotate_out_ids == [] and plan.admit_ids == []  # within free HBM only
    check_plan(rotating, plan)


def test_deadline_lag_packs_a_tight_class_prefill_first() -> None:
    """Token budget 64: two running prefills, a 25 s old batch prompt ahead in running order
    and an interactive one. §3's packing follows the running order; with deadline_lag the
    interactive chunk (deadline in 0.5 s) goes first and the batch one gets what is left."""

    def prefill(rid: str, t_arr: float, num_tokens: int, slo_ttft: float) -> RequestView:
        return RequestView(
            rid, RequestState.RUNNING, t_arr_s=t_arr, num_tokens=num_tokens,
            num_blocks_hbm=-(-num_tokens // BS), t_run_s=t_arr, slo_ttft_s=slo_ttft,
        )  # fmt: skip

    batch = prefill("batch", T_NOW - 25.0, 200, 30.0)
    interactive = prefill("interactive", T_NOW - 1.5, 32, 2.0)
    snapshot = snap(batch, interactive, free=0, budget=64)
    off = make_plan(snapshot, Knobs(policy="lvf", deadline_lag=False))
    assert off.schedule == [ScheduledChunk("batch", 64)]
    on = make_plan(snapshot, LVF)
    assert on.schedule == [ScheduledChunk("interactive", 32), ScheduledChunk("batch", 32)]
    same_class = snap(batch, prefill("b2", T_NOW - 1.5, 32, 30.0), free=0, budget=64)
    assert make_plan(same_class, LVF).schedule == [ScheduledChunk("batch", 64)]  # unchanged


def test_deadline_lag_packs_a_prefill_past_its_deadline_last() -> None:
    """Token budget 64: a batch prompt 31 s old (deadline 30 s: missed, no token yet) and an
    interactive one 1.5 s old (deadline 2 s). By deadline alone the batch one would go first;
    its TTFT is lost already, so the interactive chunk packs first. A batch prompt still due
    (in 0.2 s, before the interactive one) goes first."""

    def prefill(rid: str, t_arr: float, num_tokens: int, slo_ttft: float) -> RequestView:
        return RequestView(
            rid, RequestState.RUNNING, t_arr_s=t_arr, num_tokens=num_tokens,
            num_blocks_hbm=-(-num_tokens // BS), t_run_s=t_arr, slo_ttft_s=slo_ttft,
        )  # fmt: skip

    batch = prefill("batch", T_NOW - 31.0, 200, 30.0)
    interactive = prefill("interactive", T_NOW - 1.5, 32, 2.0)
    snapshot = snap(batch, interactive, free=0, budget=64)
    assert make_plan(snapshot, LVF).schedule == [
        ScheduledChunk("interactive", 32),
        ScheduledChunk("batch", 32),
    ]
    on_time = snap(batch._replace(t_arr_s=T_NOW - 29.8), interactive, free=0, budget=64)
    assert make_plan(on_time, LVF).schedule == [ScheduledChunk("batch", 64)]  # earliest deadline


def test_residency_yields_to_a_lagging_tighter_class() -> None:
    """A batch request resident for 0.3 s (guard 0.5 s) is spared for a waiting request of its
    own class, but not for a lagging interactive one (residency_yields_to_tighter)."""
    now = 100.0
    batch = RequestView("batch", RequestState.RUNNING, now - 5.0, 40, 40, 4, 4, t_run_s=now - 0.3,
                        t_last_s=now - 0.01, slo_ttft_s=30.0)  # fmt: skip
    fast = waiting("fast", t_arr=now - 1.2, blocks=4, slo_ttft=2.0)
    slow = waiting("slow", t_arr=now - 20.0, blocks=4, slo_ttft=30.0)
    pinned = Knobs(policy="lvf", adaptive_residency=False, min_residency_s=0.5)
    rotating = snap(batch, fast, free=0, xfer=8, t_now=now)
    assert make_plan(rotating, pinned).rotate_out_ids == ["batch"]
    held = dataclasses.replace(pinned, residency_yields_to_tighter=False)
    assert make_plan(rotating, held).rotate_out_ids == []
    same_class = snap(batch, slow, free=0, xfer=8, t_now=now)
    assert make_plan(same_class, pinned).rotate_out_ids == []
    check_plan(rotating, make_plan(rotating, pinned))


def test_lag_per_block_takes_the_most_lag_per_block_first() -> None:
    """With ``lag_per_block`` the head scan ranks lagging requests by VLT / blk(r): a small
    request lagging less goes before a big one (waiting or rotary) lagging more, when the room
    holds only one (the default); without it, L's order (VLT) decides."""
    big = waiting("big", t_arr=0.0, blocks=10, seq=1)  # lag 7.5 s: 0.75 per block
    small = waiting("small", t_arr=2.0, blocks=2, seq=2)  # lag 5.5 s: 2.75 per block
    on = LVF  # the default
    assert on.lag_per_block
    room_for_one = snap(big, small, free=10)
    assert make_plan(room_for_one, BY_VLT).admit_ids == ["big"]
    assert make_plan(room_for_one, on).admit_ids == ["small"]
    check_plan(room_for_one, make_plan(room_for_one, on))
    back = rotary("back", t_last=9.0, blocks=20, seq=3)  # VLT 3 x 1.0 s: 0.15 per block
    fresh = waiting("fresh", t_arr=6.0, blocks=2, seq=4)  # lag 1.5 s: 0.75 per block
    contended = snap(back, fresh, free=20)
    assert make_plan(contended, BY_VLT).resume_ids == ["back"]
    plan = make_plan(contended, on)
    assert plan.admit_ids == ["fresh"] and plan.resume_ids == []
    check_plan(contended, plan)
