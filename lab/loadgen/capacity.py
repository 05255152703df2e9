"""`superinfer bench --capacity`: the served SLO capacity, the highest request rate at which at
least ``--capacity-target`` (90 %) of requests meet both their TTFT and their TPOT SLO
(DistServe's goodput; ``vllm bench sweep serve_sla`` searches the same for an SLA).

Each probe is one whole ``superinfer bench`` run at a rate (the same trace, seed and class mix
every time; the server drains between probes because a run waits for its last request), and
lab/crossing.py's :class:`CrossingSearch` picks the next rate: from ``--rps`` (default 1) up or
down until the crossing is bracketed, then bisection until hi / lo <= ``--capacity-tol``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.crossing import CAPACITY_METRIC, CrossingSearch
from lab.loadgen.report import json_text

DEFAULT_CAPACITY_TOL = 1.2  # each probe is a served run: a coarser bracket than the simulator's


def add_capacity_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--capacity",
        action="store_true",
        help="search the highest --rps at which >= --capacity-target of requests meet TTFT and "
        "TPOT (each probe a run of --duration; --rps is where the search starts)",
    )
    add("--capacity-target", type=float, default=0.9, help="with --capacity (default 0.9)")
    add(
        "--capacity-tol",
        type=float,
        default=DEFAULT_CAPACITY_TOL,
        help=f"with --capacity: stop when hi/lo <= this (default {DEFAULT_CAPACITY_TOL})",
    )


def check_capacity_arguments(args: argparse.Namespace) -> None:
    """ValueError naming what --capacity cannot be combined with or lacks."""
    if not args.capacity:
        return
    if args.duration is None:
        raise ValueError("--capacity needs --duration (each probe runs that many seconds)")
    if args.plot:
        raise ValueError("--capacity runs many rates; --plot draws one run: run it at a rate")
    if not 0 < args.capacity_target <= 1:
        raise ValueError(f"--capacity-target must be in (0, 1], got {args.capacity_target}")
    if not args.capacity_tol > 1:
        raise ValueError(f"--capacity-tol must be > 1, got {args.capacity_tol}")
    if args.rps is not None and not args.rps > 0:
        raise ValueError(f"--rps must be > 0, got {args.rps}")


@dataclass(slots=True)
class CapacityResult:
    search: CrossingSearch
    rows: list[dict[str, Any]] = field(default_factory=list)  # each probe's overall row

    @property
    def capacity_rps(self) -> float:
        return self.search.capacity()

    def document(self, config: dict[str, Any]) -> dict[str, Any]:
        return {
            "config": config,
            "capacity_rps": self.capacity_rps,
            "target": self.search.threshold,
            "probes": [
                {"rps": rate, CAPACITY_METRIC: value, "row": row}
                for (rate, value), row in zip(self.search.probes, self.rows, strict=True)
            ],
        }


def search_capacity(args: argparse.Namespace, run_at: Any) -> CapacityResult:
    """Probe rates until the search is done; ``run_at(rate)`` runs the bench at ``rate`` and
    returns its overall row."""
    start = args.rps if args.rps is not None else 1.0
    search = CrossingSearch(start, args.capacity_target, tol=args.capacity_tol)
    result = CapacityResult(search)
    while (rate := search.next_rate()) is not None:
        row = run_at(rate)
        value = float(row.get(CAPACITY_METRIC) or 0.0)
        search.probes.append((rate, value))
        result.rows.append(row)
        print(
            f"probe {len(search.probes):2d}: {rate:8.3f} req/s  {CAPACITY_METRIC} "
            f"{100 * value:5.1f} %  TTFT {100 * (row.get('ttft_attainment') or 0):5.1f} %  "
            f"TPOT {100 * (row.get('tpot_attainment') or 0):5.1f} %  failed {row.get('failed')}",
            flush=True,
        )
    return result


def report_capacity(args: argparse.Namespace, result: CapacityResult, model: str) -> None:
    lo, hi = result.search.bracket()
    bracket = f"[{lo[0] if lo else 0.0:.3f}, {hi[0] if hi else float('inf'):.3f}]"
    print(
        f"{model}: SLO capacity {result.capacity_rps:.3f} req/s (>= "
        f"{100 * args.capacity_target:g} % of requests within TTFT and TPOT; probes bracket "
        f"{bracket}, {len(result.search.probes)} probes of {args.duration:g} s)"
    )
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
        config.pop("admin_token", None)
        config["model"] = model
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        text = json_text(result.document(config))
        Path(args.json).write_text(text, encoding="utf-8")
