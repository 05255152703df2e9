"""Virtual Lag Time (SUPERINFER.md §3): one priority axis for waiting, running and rotary.

:func:`vlt_array` is the product's one VLT, over columns. The one-request-at-a-time statement
of the formula it is held to lives in the tests (tests/shared/policy_reference.py).
"""

from __future__ import annotations

import numpy as np

from shared.policy.columns import RUNNING_CODE, WAITING_CODE, Floats, RequestColumns
from shared.policy.types import Knobs


def vlt_array(columns: RequestColumns, t_now_s: float, knobs: Knobs) -> Floats:
    """How far each request is behind its SLO at ``t_now_s`` (positive: lagging):

    rotary:  alpha * ReLU(t_now - t_last - beta_B * S_B)
    waiting:         ReLU(t_now - t_arr  - beta_F * S_F)
    running:       -(t_now - t_run)

    A request's own S_F/S_B (its SLO class; NaN: none) override the global knobs; a missing
    (NaN) t_run or t_last falls back to the arrival time.
    """
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
