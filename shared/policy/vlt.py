"""Virtual Lag Time (SUPERINFER.md §3): one priority axis for waiting, running and rotary."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.policy.columns import RUNNING_CODE, WAITING_CODE, Floats, RequestColumns
from shared.policy.types import Knobs, RequestState, RequestView

_RUNNING = RequestState.RUNNING
_WAITING = RequestState.WAITING


def vlt(view: RequestView, t_now_s: float, knobs: Knobs) -> float:
    """How far ``view`` is behind its SLO at ``t_now_s`` (positive: lagging).

    rotary:  alpha * ReLU(t_now - t_last - beta_B * S_B)
    waiting:         ReLU(t_now - t_arr  - beta_F * S_F)
    running:       -(t_now - t_run)
    A request's own S_F/S_B (its SLO class) override the global knobs. A missing t_run or
    t_last falls back to the arrival time.
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


def vlt_scores(views: Sequence[RequestView], t_now_s: float, knobs: Knobs) -> list[float]:
    """``[vlt(v, t_now_s, knobs) for v in views]``, bit for bit, in one tight loop (the
    planner's hot path: thousands of requests per iteration)."""
    alpha = knobs.alpha
    beta_b, beta_f = knobs.beta_b, knobs.beta_f
    tol_b, tol_f = beta_b * knobs.slo_tbt_s, beta_f * knobs.slo_ttft_s  # default tolerances
    scores: list[float] = []
    append = scores.append
    for view in views:
        state = view.state
        if state is _WAITING:
            slo = view.slo_ttft_s
            lag = t_now_s - view.t_arr_s - (tol_f if slo is None else beta_f * slo)
            append(lag if lag > 0.0 else 0.0)
        elif state is _RUNNING:
            t_run = view.t_run_s
            append(-(t_now_s - (view.t_arr_s if t_run is None else t_run)))
        else:
            slo = view.slo_tbt_s
            t_last = view.t_last_s
            lag = (
                t_now_s
                - (view.t_arr_s if t_last is None else t_last)
                - (tol_b if slo is None else beta_b * slo)
            )
            append(alpha * (lag if lag > 0.0 else 0.0))
    return scores


def vlt_array(columns: RequestColumns, t_now_s: float, knobs: Knobs) -> Floats:
    """``vlt`` of every request in ``columns``, bit for bit (the same float operations in the
    same order, element-wise; NaN stands for None)."""
    t_arr, states = columns.t_arr_s, columns.states
    waiting = states == WAITING_CODE
    # waiting and rotary alike: ReLU(t_now - since - tolerance), times alpha when rotary
    since = np.where(waiting, t_arr, _or(columns.t_last_s, t_arr))
    slo = np.where(waiting, columns.slo_ttft_s, columns.slo_tbt_s)
    beta = np.where(waiting, knobs.beta_f, knobs.beta_b)
    default = np.where(waiting, knobs.beta_f * knobs.slo_ttft_s, knobs.beta_b * knobs.slo_tbt_s)
    lag = t_now_s - since - np.where(np.isnan(slo), default, beta * slo)
    lag = np.where(lag > 0.0, lag, 0.0)
    scores = np.where(waiting, lag, knobs.alpha * lag)
    running = states == RUNNING_CODE
    return np.where(running, -(t_now_s - _or(columns.t_run_s, t_arr)), scores)


def _or(values: Floats, fallback: Floats) -> Floats:
    """``values``, with ``fallback`` where a value is NaN (None)."""
    return np.where(np.isnan(values), fallback, values)
