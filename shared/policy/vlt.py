"""Virtual Lag Time (SUPERINFER.md §3): one priority axis for waiting, running and rotary.

:func:`vlt_array` is the product's one VLT, over columns. The one-request-at-a-time statement
of the formula it is held to lives in the tests (tests/shared/policy_reference.py).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from shared.policy.columns import RUNNING_CODE, WAITING_CODE, Floats, Ints, RequestColumns
from shared.policy.types import Knobs

Bools = npt.NDArray[np.bool_]


def vlt_array(columns: RequestColumns, t_now_s: float, knobs: Knobs) -> Floats:
    """How far each request is behind its SLO at ``t_now_s`` (positive: lagging):

    rotary:  alpha * ReLU(t_now - t_last - beta_B * S_B)    [t_last: t_due - headroom]
    waiting:         ReLU(t_now - t_arr  - beta_F * S_F)
    running:       -(t_now - t_run)                       [- ReLU(t_due - t_now) with tpot_lag]

    A request's own S_F/S_B (its SLO class; NaN: none) override the global knobs; a missing
    (NaN) t_run or t_last falls back to the arrival time. With ``deadline_lag`` a waiting
    request's lag is shifted by :func:`_deadline_offsets`; with ``tpot_lag`` a rotary one's
    t_last is its last token's time on its TPOT schedule (t_due, :func:`_tpot_schedule`) less
    ``tpot_headroom_s`` (it lags that long before it falls behind the schedule), and
    a running one is ahead by its time resident plus what it is ahead of that schedule (the
    tail rotates out first the requests that can best afford a pause). ``max_pause_s`` caps
    both: t_due is at most t_last + max_pause_s, and the credit at most max_pause_s.
    """
    t_arr, states = columns.t_arr_s, columns.states
    waiting = states == WAITING_CODE
    # waiting and rotary alike: ReLU(t_now - since - tolerance), times alpha when rotary
    last = _or(columns.t_last_s, t_arr)
    if knobs.tpot_lag:
        scheduled = ~np.isnan(columns.t_first_s)
        due = _tpot_schedule(columns, last, knobs)
        if knobs.max_pause_s is not None:  # back before its pause passes max_pause_s
            due = np.minimum(due, last + knobs.max_pause_s)
        last = np.where(scheduled, due - knobs.tpot_headroom_s, last)
    since = np.where(waiting, t_arr, last)
    slo = np.where(waiting, columns.slo_ttft_s, columns.slo_tbt_s)
    beta = np.where(waiting, knobs.beta_f, knobs.beta_b)
    default = np.where(waiting, knobs.beta_f * knobs.slo_ttft_s, knobs.beta_b * knobs.slo_tbt_s)
    lag = t_now_s - since - np.where(np.isnan(slo), default, beta * slo)
    if knobs.deadline_lag and waiting.any():
        lag = lag + np.where(waiting, _deadline_offsets(columns, waiting, knobs), 0.0)
    lag = np.where(lag > 0.0, lag, 0.0)
    scores = np.where(waiting, lag, knobs.alpha * lag)
    running = states == RUNNING_CODE
    ahead_s = t_now_s - _or(columns.t_run_s, t_arr)  # a running request's time resident
    if knobs.tpot_lag:  # ... plus how far ahead of its TPOT schedule it is
        due = _tpot_schedule(columns, np.full_like(t_arr, t_now_s), knobs)
        credit_s = np.maximum(due - t_now_s, 0.0)
        if knobs.max_pause_s is not None:  # a pause it may take, not the whole credit
            credit_s = np.minimum(credit_s, knobs.max_pause_s)
        ahead_s = ahead_s + credit_s
    return np.where(running, -ahead_s, scores)


def _tpot_schedule(columns: RequestColumns, last: Floats, knobs: Knobs) -> Floats:
    """When each request's last token was due if it produced one every S_B since its first
    (TPOT, the mean time between tokens, met exactly): t_first + (n - 1) * S_B for n tokens.
    Earlier than its last token when it is behind that schedule, later when ahead (it may
    then wait that much longer and still meet its TPOT); ``last`` where it has no token yet."""
    s_b = _or(columns.slo_tbt_s, np.full_like(columns.t_arr_s, knobs.slo_tbt_s))
    due = columns.t_first_s + np.maximum(columns.num_output_tokens - 1, 0) * s_b
    return np.where(np.isnan(columns.t_first_s), last, due)


def _deadline_offsets(columns: RequestColumns, waiting: Bools, knobs: Knobs) -> Floats:
    """(1 - beta_F) * (S_max - S_F) per request, S_max the loosest S_F among the waiting
    requests: a waiting request's lag then counts from its deadline (t_now - t_arr - S_F +
    (1 - beta_F) * S_max), so waiting requests rank by deadline (EDF) across SLO classes; the
    loosest class's lag is VLT's, and with one class nothing changes (offsets exactly 0)."""
    slo = _or(columns.slo_ttft_s, np.full_like(columns.t_arr_s, knobs.slo_ttft_s))
    return (1.0 - knobs.beta_f) * (float(slo[waiting].max()) - slo)


def prefills_by_deadline(
    columns: RequestColumns, order: Ints, knobs: Knobs, t_now_s: float
) -> Ints:
    """``order`` for packing with ``deadline_lag``: its prefills (every row that is not a
    one-token decode) stably sorted by TTFT deadline (t_arr + S_F), after its decodes in their
    order, when the prefills span more than one S_F; else ``order`` unchanged. A tight
    class's prompt is then not starved of the token budget by a loose class's long one. The
    prefills past their deadline without a first token (running chunks too) and, with
    ``demote_late_s``, the late waiting requests (:func:`late_waiting`) come after the
    others: the earliest deadlines are theirs, and their TTFT is lost already (on Mooncake
    at 1.5x the knee the interactive class went -4.5 -> -3.1 points from its run alone,
    docs/benchmarks.md)."""
    if not knobs.deadline_lag or len(order) < 2:
        return order
    computed = columns.num_computed_tokens[order]
    prefill = ~((columns.num_tokens[order] - computed == 1) & (computed > 0))
    rows = order[prefill]
    slo = _or(columns.slo_ttft_s[rows], np.full(len(rows), knobs.slo_ttft_s))
    if len(rows) < 2 or slo.min() == slo.max():
        return order
    deadlines = columns.t_arr_s[rows] + slo
    late = late_waiting(columns, t_now_s, knobs)
    last = np.zeros(len(rows), np.bool_) if late is None else late[rows]
    last = last | (np.isnan(columns.t_last_s[rows]) & (deadlines < t_now_s))  # TTFT missed
    return np.concatenate((order[~prefill], rows[np.lexsort((deadlines, last))]))


def looser_than_lagging(columns: RequestColumns, scores: Floats, knobs: Knobs) -> Bools | None:
    """Per request: its S_F is looser than the tightest S_F among the lagging waiting requests
    (None when nobody waiting lags). A request of a tight class may then rotate a loose
    class's request out before its residency is served."""
    lagging = (columns.states == WAITING_CODE) & (scores > 0)
    if not lagging.any():
        return None
    slo = _or(columns.slo_ttft_s, np.full_like(columns.t_arr_s, knobs.slo_ttft_s))
    looser: Bools = slo > float(slo[lagging].min())
    return looser


def late_waiting(columns: RequestColumns, t_now_s: float, knobs: Knobs) -> Bools | None:
    """With ``demote_late_s`` set: the waiting requests without a first token whose TTFT SLO
    is missed by more than that at ``t_now_s`` (None when the knob is off or none is)."""
    if knobs.demote_late_s is None:
        return None
    slo = _or(columns.slo_ttft_s, np.full_like(columns.t_arr_s, knobs.slo_ttft_s))
    late = (columns.states == WAITING_CODE) & np.isnan(columns.t_last_s)
    late &= t_now_s - columns.t_arr_s - slo > knobs.demote_late_s
    return late if late.any() else None


def _or(values: Floats, fallback: Floats) -> Floats:
    """``values``, with ``fallback`` where a value is NaN (None)."""
    return np.where(np.isnan(values), fallback, values)
