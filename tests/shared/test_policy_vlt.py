"""VLT (SUPERINFER.md §3) and knob validation, on hand-built views."""

from __future__ import annotations

import pytest

from shared.policy import Knobs, RequestState, RequestView, columns_from_views, make_plan, vlt_array
from tests.shared.policy_reference import vlt
from tests.shared.policy_views import (
    LVF,
    T_NOW,
    rotary,
    running,
    snap,
    waiting,
)


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
    for knobs in (LVF, Knobs(alpha=0.7, beta_b=-1.5, beta_f=1.3, slo_ttft_s=3.0)):
        scores = vlt_array(columns_from_views(views), T_NOW, knobs).tolist()
        assert scores == [vlt(v, T_NOW, knobs) for v in views]


def test_knobs_reject_invalid_values() -> None:
    with pytest.raises(ValueError, match="alpha"):
        Knobs(alpha=-0.1)
    with pytest.raises(ValueError):
        Knobs(slo_tbt_s=0.0)
    with pytest.raises(ValueError, match="b_xfer"):
        Knobs(b_xfer=-1)
    with pytest.raises(ValueError, match="unknown policy"):
        make_plan(snap(free=1), Knobs(policy="sjf"))


# ---- step 1: the contention check ----------------------------------------------------------
