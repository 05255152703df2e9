"""Virtual Lag Time (SUPERINFER.md §3): one priority axis for waiting, running and rotary."""

from __future__ import annotations

from shared.policy.types import Knobs, RequestState, RequestView


def vlt(view: RequestView, t_now_s: float, knobs: Knobs) -> float:
    """How far ``view`` is behind its SLO at ``t_now_s`` (positive: lagging).

    rotary:  alpha * ReLU(t_now - t_last - beta_B * S_B)
    waiting:         ReLU(t_now - t_arr  - beta_F * S_F)
    running:       -(t_now - t_run)
    A request's own S_F/S_B (its SLO class) override the global knobs.
    """
    if view.state is RequestState.RUNNING:
        t_run = view.t_run_s if view.t_run_s is not None else view.t_arr_s
        return -(t_now_s - t_run)
    if view.state is RequestState.ROTARY:
        slo_tbt_s = view.slo_tbt_s if view.slo_tbt_s is not None else knobs.slo_tbt_s
        t_last = view.t_last_s if view.t_last_s is not None else view.t_arr_s
        return knobs.alpha * max(0.0, t_now_s - t_last - knobs.beta_b * slo_tbt_s)
    slo_ttft_s = view.slo_ttft_s if view.slo_ttft_s is not None else knobs.slo_ttft_s
    return max(0.0, t_now_s - view.t_arr_s - knobs.beta_f * slo_ttft_s)
