"""Where a metric that falls with the request rate crosses a threshold (SLO capacity, a knee),
found with few probes: :class:`CrossingSearch`. It only proposes rates and takes their
metric, so the same search drives simulations (lab/sim/capacity.py) and served runs
(``superinfer bench --capacity``, lab/loadgen/capacity.py).

From ``start`` it steps up or down by ``step``, ``step**2``, ``step**3``... until the crossing
is bracketed, then bisects geometrically until hi / lo <= ``tol`` and interpolates linearly
inside the bracket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CAPACITY_TARGET = 0.9
CAPACITY_METRIC = "slo_attainment"
MAX_PROBES = 12
MIN_SEARCH_RPS, MAX_SEARCH_RPS = 0.01, 256.0  # the search stops outside (no crossing)


@dataclass(slots=True)
class CrossingSearch:
    """One search; ``probes`` holds (rate, metric) in the order run."""

    start: float
    threshold: float
    tol: float = 1.1
    step: float = 2.0
    probes: list[tuple[float, float]] = field(default_factory=list)
    fixed: float | None = None  # set: no search, this is the crossing (a table's value)

    def __post_init__(self) -> None:
        if not self.start > 0 or not self.tol > 1 or not self.step > 1:
            raise ValueError(
                f"need start > 0, tol > 1, step > 1; got {self.start}, {self.tol}, {self.step}"
            )

    def bracket(self) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
        """(highest probe at or above the threshold, lowest probe above it that is below)."""
        ok = [p for p in self.probes if p[1] >= self.threshold]
        lo = max(ok) if ok else None
        bad = [p for p in self.probes if p[1] < self.threshold and (lo is None or p[0] > lo[0])]
        return lo, (min(bad) if bad else None)

    def next_rate(self) -> float | None:
        """The next rate to probe, None when done."""
        if self.fixed is not None or len(self.probes) >= MAX_PROBES:
            return None
        if not self.probes:
            return self.start
        lo, hi = self.bracket()
        widen = self.step ** min(len(self.probes), 3)
        if lo is None:
            return None if hi is None or hi[0] <= MIN_SEARCH_RPS else hi[0] / widen
        if hi is None:
            return None if lo[0] >= MAX_SEARCH_RPS else min(lo[0] * widen, MAX_SEARCH_RPS)
        return None if hi[0] / lo[0] <= self.tol * (1 + 1e-9) else math.sqrt(lo[0] * hi[0])

    def crossing(self) -> float:
        """The crossing, interpolated linearly inside the final bracket; without a bracket the
        probe nearest to one (the search ran out of range or probes)."""
        if self.fixed is not None:
            return self.fixed
        lo, hi = self.bracket()
        if lo is None or hi is None:
            return (hi or lo or (self.start, 0.0))[0]
        span = lo[1] - hi[1]
        frac = (lo[1] - self.threshold) / span if span > 0 else 0.5
        return lo[0] + frac * (hi[0] - lo[0])

    def capacity(self) -> float:
        """The highest rate meeting the threshold: the crossing, 0.0 when even the lowest rate
        probed falls short."""
        lo, _ = self.bracket()
        return 0.0 if lo is None and self.fixed is None else self.crossing()
