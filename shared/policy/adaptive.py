"""An online controller for LVF's minimum residency: rotate freely while decoding keeps its
TBT promise, back off towards FCFS when rotations make started requests wait.

SUPERINFER.md tunes alpha/beta/B_xfer by hand per workload; a fixed ``min_residency_s`` that
wins at the knee of one trace rotates too much at twice the knee of another (docs/benchmarks.md:
0.25 s gains most TTFT at the knee, 0.5 s keeps goodput at overload). The controller observes
the one cost a rotation imposes, the started requests kept waiting for their next token, from
each snapshot alone (no extra counters, no wire fields):

    overdue(t) = mean over started requests of clip((t - t_last) / S_B - 1, 0, cap)

that is how many TBT objectives each started request is currently late, on average. It keeps
an exponential average over ``window_s`` of it and, once per ``period_s``:

- above ``overdue_high``: doubles the residency (up to ``max_s``: rotations become rare, LVF
  behaves as FCFS with LVF's admission order);
- below ``overdue_low``: divides it by 1.5 (down to ``min_s``).

An engine's controller (:func:`residency_controller`) starts at the ``min_residency_s`` knob and
takes it as ``min_s``: the knob is the least residency, the controller only raises it. With
``tpot_lag`` a running request's credit counts towards its residency, so a floor under a
second let the tail rotate out short requests a few tokens in (Azure code: 2,551 rotations
for 560 requests of ~28 tokens at 14 req/s on the gh200, seed 0: TPOT met by 66 %; floor
2 s: 79 rotations, 99 %).

The policy itself stays a pure function: :func:`controlled_knobs` returns the knobs to plan
with; the state lives in a small object one planner per engine owns (the worker's, or the
simulator's). A worker's value travels in its snapshots and the control plane plans with it
(:func:`residency_knobs`), so there is one controller per worker whoever plans. Operators see
``value_s`` (metrics, admin) and pin the residency by turning the ``adaptive_residency`` knob
off.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from shared.policy.columns import ColumnarSnapshot, columnar_from_snapshot
from shared.policy.types import Knobs, Snapshot

OVERDUE_CAP = 20.0  # one request out for minutes must not stand for the whole batch
RAISE_FROM_S = 0.1  # a residency of 0 is raised as if it were this (doubling 0 stays 0)


@dataclass(slots=True)
class ResidencyController:
    """State of the controller for one engine; ``value_s`` is the residency to plan with."""

    min_s: float = 0.1
    max_s: float = 8.0
    overdue_high: float = 2.0
    overdue_low: float = 0.6
    window_s: float = 4.0
    period_s: float = 1.0
    value_s: float = 0.5
    overdue: float = 0.0  # the exponential average
    _t_sample_s: float | None = field(default=None, repr=False)
    _t_decided_s: float | None = field(default=None, repr=False)

    def observe(self, snapshot: ColumnarSnapshot, default_slo_tbt_s: float) -> float:
        """Fold one snapshot in; returns the residency to plan this iteration with."""
        now = snapshot.t_now_s
        sample = overdue_now(snapshot, default_slo_tbt_s)
        if self._t_sample_s is None:
            self.overdue, self._t_decided_s = sample, now
        else:
            weight = 1.0 - math.exp(-max(0.0, now - self._t_sample_s) / self.window_s)
            self.overdue += weight * (sample - self.overdue)
        self._t_sample_s = now
        if self._t_decided_s is not None and now - self._t_decided_s >= self.period_s:
            self._t_decided_s = now
            if self.overdue > self.overdue_high:
                self.value_s = min(self.max_s, max(self.value_s, RAISE_FROM_S) * 2.0)
            elif self.overdue < self.overdue_low:
                self.value_s = max(self.min_s, self.value_s / 1.5)
        return self.value_s


def residency_controller(knobs: Knobs) -> ResidencyController:
    """The controller for an engine planning with ``knobs``: it starts at ``min_residency_s``
    and never goes below it (the knob is the least residency; the controller only raises it
    while rotations make started requests wait)."""
    floor_s = knobs.min_residency_s
    return ResidencyController(min_s=floor_s, max_s=max(8.0, floor_s), value_s=floor_s)


def overdue_now(snapshot: ColumnarSnapshot, default_slo_tbt_s: float) -> float:
    """Mean TBT objectives by which the started requests are late at ``snapshot.t_now_s``."""
    columns = snapshot.requests
    t_last = columns.t_last_s
    started = ~np.isnan(t_last)
    if not started.any():
        return 0.0
    slo = columns.slo_tbt_s[started]
    slo = np.where(np.isnan(slo), default_slo_tbt_s, slo)
    late = (snapshot.t_now_s - t_last[started]) / slo - 1.0
    return float(np.clip(late, 0.0, OVERDUE_CAP).mean())


def controlled_knobs(
    snapshot: Snapshot | ColumnarSnapshot, knobs: Knobs, controller: ResidencyController
) -> tuple[Snapshot | ColumnarSnapshot, Knobs]:
    """``knobs`` with the controller's residency when LVF runs with ``adaptive_residency``
    (the snapshot comes back as columns then, so that LVF does not convert it twice)."""
    if not _adapts(knobs):
        return snapshot, knobs
    if isinstance(snapshot, Snapshot):
        snapshot = columnar_from_snapshot(snapshot)
    residency_s = controller.observe(snapshot, knobs.slo_tbt_s)
    return snapshot, dataclasses.replace(knobs, min_residency_s=residency_s)


def residency_knobs(knobs: Knobs, residency_s: float | None) -> Knobs:
    """``knobs`` with ``residency_s``, a controller's value (the worker's, from its snapshot),
    when LVF runs with ``adaptive_residency``; unchanged otherwise or without a value."""
    if residency_s is None or not _adapts(knobs):
        return knobs
    return dataclasses.replace(knobs, min_residency_s=residency_s)


def _adapts(knobs: Knobs) -> bool:
    return knobs.policy == "lvf" and knobs.adaptive_residency
