"""Where a metric that falls with the request rate crosses a threshold: SLO capacity.

SLO capacity (DistServe's goodput; ``vllm bench sweep serve_sla``) is the highest rate at which
at least ``target`` (90 %) of requests meet both their TTFT and their TPOT SLO: the rate where the
row's ``slo_attainment`` crosses ``target``. A :class:`CrossingSearch` finds such a crossing with
few simulations: from ``start`` it steps up or down by ``step``, ``step**2``, ``step**3``...
until the crossing is bracketed, then bisects geometrically until hi / lo <= ``tol`` and
interpolates linearly inside the bracket. Searches of many (trace, profile, policy, seed) keys
advance in lock step (:func:`run_searches`), one simulation each per round, a round's runs spread
over processes. ``bench/sched_compare.py`` finds vllm's knee (TTFT attainment 50 %) this way too.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from lab.sim.sweep import SweepJob, run_sweep
from lab.stats import mean_interval, ratio_interval

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


K = TypeVar("K", bound=Hashable)


def run_searches(
    searches: Mapping[K, CrossingSearch],
    make_job: Callable[[K, float], SweepJob],
    metric: str,
    workers: int = 1,
    on_probe: Callable[[K, float, dict[str, Any]], None] | None = None,
) -> None:
    """Advance every search until all are done: each round runs one job per unfinished search
    (``make_job(key, rate)``) over ``workers`` processes and records the row's ``metric``;
    ``on_probe(key, rate, row)`` sees every row."""
    while True:
        todo: list[tuple[K, CrossingSearch, float]] = []
        for key, search in searches.items():
            rate = search.next_rate()
            if rate is not None:
                todo.append((key, search, rate))
        if not todo:
            return
        jobs = [make_job(key, rate) for key, _, rate in todo]
        for (key, s, rate), (row, _) in zip(todo, run_sweep(jobs, workers), strict=True):
            s.probes.append((rate, float(row[metric])))
            if on_probe is not None:
                on_probe(key, rate, row)


def run_capacity_mode(
    jobs: Sequence[SweepJob], config: dict[str, Any], target: float, workers: int, json_path: str
) -> int:
    """``superinfer simulate --capacity``: each of ``jobs`` (one per policy and seed, at the
    search's start rate) becomes a search of its SLO capacity; prints each policy's capacity
    (mean over seeds, 95 % bootstrap interval) and its ratio to the first policy's."""
    searches = {i: CrossingSearch(job.rps, target) for i, job in enumerate(jobs)}
    probes: list[dict[str, Any]] = []

    def show(index: int, rate: float, row: dict[str, Any]) -> None:
        job = jobs[index]
        probes.append({"label": job.name, "seed": job.seed, **row})
        print(f"  {job.name} @ {rate:.3g} req/s: both SLOs {100 * row[CAPACITY_METRIC]:.1f} %")

    try:
        run_searches(searches, lambda i, r: replace(jobs[i], rps=r), CAPACITY_METRIC, workers, show)
    except ValueError as exc:  # e.g. burstiness on a trace with real arrivals
        print(f"error: {exc}", file=sys.stderr)
        return 2
    by_policy: dict[str, list[float]] = {}
    for i, job in enumerate(jobs):
        by_policy.setdefault(job.policy, []).append(searches[i].capacity())
    summary = capacity_summary(by_policy)
    for line in capacity_lines(summary, target):
        print(line)
    out = {"config": config, "capacity": summary, "probes": probes}
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0


def capacity_summary(by_policy: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Per policy: capacities per seed, their mean and interval, and the ratio to the first
    policy's (a ratio of sums over paired seeds, with its interval)."""
    base = next(iter(by_policy.values()))
    out: dict[str, dict[str, Any]] = {}
    for policy, values in by_policy.items():
        mean, ratio = mean_interval(values), ratio_interval(values, base)
        out[policy] = {
            "capacity_rps": values,
            "mean": mean.value,
            "lo": mean.lo,
            "hi": mean.hi,
            "ratio": ratio.value,
            "ratio_lo": ratio.lo,
            "ratio_hi": ratio.hi,
        }
    return out


def capacity_lines(summary: dict[str, dict[str, Any]], target: float) -> list[str]:
    base = next(iter(summary))
    lines = [f"SLO capacity (>= {100 * target:g} % of requests meet TTFT and TPOT), req/s:"]
    for policy, s in summary.items():
        seeds = ", ".join(f"{v:.3g}" for v in s["capacity_rps"])
        line = f"  {policy:14s} {s['mean']:.3g} [{s['lo']:.3g}, {s['hi']:.3g}] (seeds: {seeds})"
        if policy != base:
            line += f"  {s['ratio']:.2f}x {base} [{s['ratio_lo']:.2f}, {s['ratio_hi']:.2f}]"
        lines.append(line)
    return lines
