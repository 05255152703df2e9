"""Where a metric that falls with the request rate crosses a threshold: SLO capacity.

SLO capacity (DistServe's goodput; ``vllm bench sweep serve_sla``) is the highest rate at which
at least ``target`` (90 %) of requests meet both their TTFT and their TPOT SLO: the rate where the
row's ``slo_attainment`` crosses ``target``, found by lab/crossing.py's
:class:`CrossingSearch` with few simulations. Searches of many (trace, profile, policy, seed) keys
advance in lock step (:func:`run_searches`), one simulation each per round, a round's runs spread
over processes. ``bench/sched_compare.py`` finds vllm's knee (TTFT attainment 50 %) this way too.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from lab.crossing import (
    CAPACITY_METRIC,
    CrossingSearch,
)
from lab.sim.sweep import SweepJob, run_sweep
from lab.stats import mean_interval, ratio_interval

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
