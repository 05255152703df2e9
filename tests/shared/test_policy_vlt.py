"""VLT (SUPERINFER.md §3) and knob validation, on hand-built views."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.policy import Knobs, RequestState, RequestView, columns_from_views, make_plan, vlt_array
from shared.policy.vlt import late_waiting
from tests.shared.policy_reference import vlt
from tests.shared.policy_views import (
    LVF,
    T_NOW,
    rotary,
    running,
    snap,
    waiting,
)

TPOT = replace(LVF, tpot_lag=True)  # the knob these tests are about (off by default)


def test_vlt_waiting_lags_only_after_beta_f_times_ttft_slo() -> None:
    view = waiting("w", t_arr=0.0)
    assert vlt(view, 10.0, LVF) == pytest.approx(10.0 - 0.5 * 5.0)  # defaults: beta_F 0.5, S_F 5
    assert vlt(view, 2.5, LVF) == 0.0  # exactly at the tolerance
    assert vlt(view, 1.0, LVF) == 0.0  # ReLU: never negative
    assert vlt(view, 10.0, Knobs(beta_f=0.0)) == pytest.approx(10.0)
    assert vlt(view, 10.0, Knobs(beta_f=1.0)) == pytest.approx(5.0)
    assert vlt(view, 10.0, Knobs(beta_f=3.0)) == 0.0
    assert vlt(view, 10.0, Knobs(slo_ttft_s=2.0)) == pytest.approx(9.0)
    # a request's own SLO class overrides the global S_F
    assert vlt(waiting("w", t_arr=0.0, slo_ttft=2.0), 10.0, LVF) == pytest.approx(9.0)
    assert vlt(waiting("w", t_arr=0.0, slo_ttft=30.0), 10.0, LVF) == 0.0


def test_vlt_rotary_is_alpha_times_tbt_lag() -> None:
    view = rotary("r", t_last=9.0)  # last token 1 s ago
    assert vlt(view, 10.0, LVF) == pytest.approx(3.0)  # alpha 3, beta_B 0
    assert vlt(view, 10.0, Knobs(alpha=1.0)) == pytest.approx(1.0)
    assert vlt(view, 10.0, Knobs(alpha=0.0)) == 0.0
    assert vlt(view, 10.0, Knobs(beta_b=5.0)) == pytest.approx(3.0 * (1.0 - 0.5))  # S_B 0.1
    assert vlt(view, 10.0, Knobs(beta_b=-2.0)) == pytest.approx(3.0 * (1.0 + 0.2))
    assert vlt(view, 10.0, Knobs(beta_b=20.0)) == 0.0  # within tolerance: ReLU
    assert vlt(view, 10.0, Knobs(beta_b=5.0, slo_tbt_s=0.05)) == pytest.approx(3.0 * 0.75)
    own_slo = rotary("r", t_last=9.0, slo_tbt=0.05)  # its own S_B beats the knob
    assert vlt(own_slo, 10.0, Knobs(beta_b=5.0, slo_tbt_s=1.0)) == pytest.approx(3.0 * 0.75)
    never_decoded = RequestView("r", RequestState.ROTARY, t_arr_s=8.0, num_tokens=4)
    assert vlt(never_decoded, 10.0, LVF) == pytest.approx(6.0)  # t_last falls back to t_arr


def test_tpot_lag_counts_a_rotary_request_from_its_tpot_schedule() -> None:
    """S_B 0.1: 31 tokens since a first token at t = 4 are due by 4 + 30 x 0.1 = 7, so at
    t = 10 the request is 3 s behind its TPOT (alpha 3: VLT 9) though its last token came 1 s
    ago; with its first token at 8 it is 1 s ahead (VLT 0); without a first token, or with
    the knob off, the lag counts from its last token (VLT 3). No headroom here."""
    behind = rotary("r", t_last=9.0)._replace(t_first_s=4.0, num_output_tokens=31)
    ahead = behind._replace(t_first_s=8.0)
    no_first = rotary("r", t_last=9.0)
    tbt = Knobs(tpot_lag=False)
    lvf = replace(TPOT, tpot_headroom_s=0.0)
    expected = {(behind, lvf): 9.0, (ahead, lvf): 0.0, (no_first, lvf): 3.0, (behind, tbt): 3.0}
    for (view, knobs), value in expected.items():
        assert vlt(view, 10.0, knobs) == pytest.approx(value)
        assert vlt_array(columns_from_views([view]), 10.0, knobs)[0] == pytest.approx(value)


def test_tpot_headroom_makes_a_rotary_request_lag_before_its_schedule_runs_out() -> None:
    """11 tokens since t = 9 are due by 10.3: at t = 10 the request is 0.3 s ahead of its
    TPOT schedule. Without headroom it does not lag yet; with 0.5 s it lags by 0.2 s (alpha
    3: VLT 0.6); a request without a first token is not moved by the headroom."""
    ahead = rotary("r", t_last=9.9)._replace(t_first_s=9.3, num_output_tokens=11)
    no_first = rotary("r", t_last=9.0)
    expected = {(ahead, 0.0): 0.0, (ahead, 0.5): 0.6, (no_first, 0.0): 3.0, (no_first, 0.5): 3.0}
    for (view, headroom_s), value in expected.items():
        knobs = replace(TPOT, tpot_headroom_s=headroom_s)
        assert vlt(view, 10.0, knobs) == pytest.approx(value)
        assert vlt_array(columns_from_views([view]), 10.0, knobs)[0] == pytest.approx(value)


def test_tpot_lag_resumes_the_request_furthest_behind_its_tpot_first() -> None:
    """Room for one of two rotary requests of 2 blocks: ``recent`` produced its last token
    0.5 s ago but is 5 s behind its TPOT schedule (31 tokens since t = 2), ``idle`` waited 2 s
    since its last token and is 2 s behind (11 tokens since t = 7). By the last token, idle
    goes first; by the TPOT schedule, recent does."""
    recent = rotary("recent", t_last=T_NOW - 0.5)._replace(t_first_s=2.0, num_output_tokens=31)
    idle = rotary("idle", t_last=T_NOW - 2.0, seq=1)._replace(t_first_s=7.0, num_output_tokens=11)
    snapshot = snap(recent, idle, free=3)
    assert make_plan(snapshot, replace(TPOT, tpot_lag=False)).resume_ids == ["idle"]
    assert make_plan(snapshot, TPOT).resume_ids == ["recent"]


def test_tpot_lag_counts_a_running_request_ahead_by_its_tpot_credit() -> None:
    """Resident since t = 8 (2 s at t = 10): 61 tokens since t = 5 are due by 5 + 6 = 11, so
    it is also 1 s ahead of its TPOT: VLT -3 (-2 with the knob off, or behind schedule)."""
    ahead = running("x", t_run=8.0)._replace(t_first_s=5.0, num_output_tokens=61)
    behind = ahead._replace(t_first_s=2.0)
    expected = {(ahead, TPOT): -3.0, (ahead, Knobs(tpot_lag=False)): -2.0, (behind, TPOT): -2.0}
    for (view, knobs), value in expected.items():
        assert vlt(view, 10.0, knobs) == pytest.approx(value)
        assert vlt_array(columns_from_views([view]), 10.0, knobs)[0] == pytest.approx(value)


def test_tpot_lag_rotates_out_the_request_most_ahead_of_its_tpot_first() -> None:
    """A lagging waiting request needs 2 blocks, HBM is full: of two running requests resident
    as long, §3's tail takes the later arrival (``late``); with tpot_lag the one 1.9 s ahead of
    its TPOT schedule (``ahead``, 100 tokens since t = 2 are due by 11.9) goes instead."""
    ahead = running("ahead", t_run=1.0, dram=2)._replace(t_first_s=2.0, num_output_tokens=100)
    late = running("late", t_run=1.0, seq=1, dram=2)._replace(t_first_s=2.0, num_output_tokens=60)
    snapshot = snap(ahead, late, waiting("w", t_arr=0.0, blocks=2, seq=2), free=0, xfer=4)
    assert make_plan(snapshot, replace(TPOT, tpot_lag=False)).rotate_out_ids == ["late"]
    assert make_plan(snapshot, TPOT).rotate_out_ids == ["ahead"]


def test_vlt_running_falls_with_time_in_running() -> None:
    assert vlt(running("x", t_run=4.0), 10.0, LVF) == pytest.approx(-6.0)
    assert vlt(running("x", t_run=4.0), 10.0, Knobs(alpha=9.0, beta_f=2.0)) == pytest.approx(-6.0)
    assert vlt(running("x", t_run=10.0), 10.0, LVF) == 0.0
    fresh = RequestView("x", RequestState.RUNNING, t_arr_s=7.0, num_tokens=4)
    assert vlt(fresh, 10.0, LVF) == pytest.approx(-3.0)  # t_run falls back to t_arr


def test_vlt_array_matches_vlt_bit_for_bit() -> None:
    views = [
        waiting("w1", t_arr=0.3),
        waiting("w2", t_arr=9.9),
        waiting("w3", t_arr=1.0, slo_ttft=1.7),
        rotary("r1", t_last=9.1),
        rotary("r2", t_last=9.95, slo_tbt=0.03),
        running("x1", t_run=3.3),
        RequestView("x2", RequestState.RUNNING, t_arr_s=2.0, num_tokens=3),
    ]
    other = Knobs(alpha=0.7, beta_b=-1.5, beta_f=1.3, slo_ttft_s=3.0)
    for knobs in (LVF, other, replace(LVF, deadline_lag=False), replace(other, deadline_lag=False)):
        scores = vlt_array(columns_from_views(views), T_NOW, knobs).tolist()
        loosest = max(1.7, knobs.slo_ttft_s)  # w1, w2 in the default class, w3 in a 1.7 s one
        assert scores == [vlt(v, T_NOW, knobs, loosest) for v in views]


def test_deadline_lag_ranks_waiting_requests_by_deadline_across_classes() -> None:
    batch_old = waiting("batch", t_arr=0.0, slo_ttft=30.0)  # 25 s old, deadline in 5 s
    fresh = waiting("interactive", t_arr=23.5, slo_ttft=2.0)  # 1.5 s old, deadline in 0.5 s
    columns = columns_from_views([batch_old, fresh])
    seconds = vlt_array(columns, 25.0, replace(LVF, deadline_lag=False)).tolist()
    assert seconds == pytest.approx([10.0, 0.5])  # §3: the batch request ranks first
    by_deadline = vlt_array(columns, 25.0, LVF).tolist()
    assert by_deadline == pytest.approx([10.0, 0.5 + 0.5 * (30.0 - 2.0)])  # EDF: interactive
    assert by_deadline[1] > by_deadline[0]
    # one class: exactly §3's lag, whatever that class's SLO (offsets are 0.0)
    same = [waiting("a", t_arr=0.0, slo_ttft=9.0), waiting("b", t_arr=20.0, slo_ttft=9.0)]
    one_class = columns_from_views([*same, rotary("r", t_last=24.0)])
    assert (
        vlt_array(one_class, 25.0, LVF).tolist()
        == vlt_array(one_class, 25.0, replace(LVF, deadline_lag=False)).tolist()
    )


def test_late_waiting_marks_requests_past_their_ttft_by_more_than_the_knob() -> None:
    views = [
        waiting("missed", t_arr=0.0, slo_ttft=2.0),  # 3 s old: missed by 1 s
        waiting("on_time", t_arr=2.0, slo_ttft=2.0),  # 1 s old
        waiting("default_class", t_arr=0.0),  # 3 s old, S_F 5 s
        rotary("rotary", t_last=0.0),  # has its first token: never late for TTFT
        RequestView("preempted", RequestState.WAITING, t_arr_s=0.0, num_tokens=4, t_last_s=1.0),
    ]
    columns = columns_from_views(views)
    assert late_waiting(columns, 3.0, LVF) is None  # the knob is off
    marks = late_waiting(columns, 3.0, replace(LVF, demote_late_s=0.5))
    assert marks is not None and marks.tolist() == [True, False, False, False, False]
    assert late_waiting(columns, 3.0, replace(LVF, demote_late_s=1.0)) is None  # by more than
    with pytest.raises(ValueError, match="demote_late_s"):
        Knobs(demote_late_s=-1.0)


def test_knobs_reject_invalid_values() -> None:
    with pytest.raises(ValueError, match="alpha"):
        Knobs(alpha=-0.1)
    with pytest.raises(ValueError):
        Knobs(slo_tbt_s=0.0)
    for b_xfer in (-1, 0):  # 0 would leave copies already queued stranded
        with pytest.raises(ValueError, match="b_xfer"):
            Knobs(b_xfer=b_xfer)
    with pytest.raises(ValueError, match="'sjf' is not one of"):  # a worker's --policy typo
        Knobs(policy="sjf")


# ---- step 1: the contention check ----------------------------------------------------------
