"""Tuning curves: LVF's SLO attainment as one knob moves, the others at their defaults, on two
traces at a contended rate, in the simulator (the real engine, KV tiers and policy on the cost
model; lab/sim). docs/tuning.md embeds the figure and reads the table.

What runs: ShareGPT-8k length stats (Poisson arrivals, 16 GiB HBM) and the Azure LLM code trace
(its real arrivals rescaled, 2 GiB HBM), DRAM 8x HBM as in bench/sched_compare.py, on the
h200-llama3-8b profile, 30 s of arrivals (``--duration``) at a rate where vllm's TTFT
attainment is below 50 % (sharegpt 12 req/s, azure-code 11 req/s: about 1.35x and 1.6x the
40-s knees of sched_compare's table; a 30-s window is less contended than 40 s). One sweep per
knob, every other knob at its default:

- ``alpha`` 0.5-12; ``beta_f`` 0-2; ``beta_b`` -0.5-2 (SUPERINFER.md §3);
- ``b_xfer`` 75-4800 blocks per iteration (the default is ``auto``, plotted as a marker);
- ``min_residency_s`` 0-4 s with ``adaptive_residency`` off (the default, adaptive, as a
  marker);

plus vllm (the reference line) and lvf at the defaults. 2 x (5 + 5 + 5 + 6 + 6 + 2) = 58 runs,
~3 min on one core (lvf 0.5-5 s a run).

Output: ``--out``/tuning_curves.json (rows per run), ``--plot`` (default
docs/img/tuning_curves.png: TTFT and TBT attainment against each knob, one line per trace,
vllm dashed), a table per trace, and the last line ``RESULT tuning_curves``: the wall time, the
runs, and per trace the default's TTFT/TBT attainment, vllm's, and the knob value with the best
goodput per sweep (``<trace>_<knob>_best``).

    .venv/bin/python bench/tuning_curves.py [--duration 30] [--workers 2] [--out bench/out]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sched_compare import (
    H200,
    REPO,
    TRACES,
    Workload,
    horizon_s,
    kit_workloads,
)
from lab.costmodel import load_profile
from lab.sim.setup import SimSetup
from lab.sim.sweep import SweepJob, run_sweep
from shared.policy import Knobs

RATES = {"sharegpt": 12.0, "azure-code": 11.0}
# knob -> values swept; b_xfer is the setup's budget, min_residency_s runs with the adaptive
# controller off (else it is only the controller's starting value).
SWEEPS: dict[str, tuple[float, ...]] = {
    "alpha": (0.5, 1.0, 3.0, 6.0, 12.0),
    "beta_f": (0.0, 0.25, 0.5, 1.0, 2.0),
    "beta_b": (-0.5, 0.0, 0.5, 1.0, 2.0),
    "b_xfer": (75.0, 150.0, 300.0, 1200.0, 2400.0, 4800.0),
    "min_residency_s": (0.0, 0.25, 0.5, 1.0, 2.0, 4.0),
}
DEFAULTS = Knobs(policy="lvf", b_xfer=None)


@dataclass(frozen=True, slots=True)
class Point:
    trace: str
    knob: str  # a SWEEPS key, or "default" / "vllm"
    value: float | None


def job_for(w: Workload, point: Point, duration_s: float) -> SweepJob:
    knobs: Knobs = DEFAULTS
    b_xfer: int | str = "auto"
    changes: dict[str, Any] = {}
    if point.knob == "b_xfer":
        b_xfer = int(point.value or 0)
    elif point.knob == "min_residency_s":
        knobs = replace(knobs, min_residency_s=point.value or 0.0, adaptive_residency=False)
    elif point.knob in SWEEPS:
        changes[point.knob] = point.value
        knobs = replace(knobs, **changes)
    policy = "vllm" if point.knob == "vllm" else "lvf"
    setup = SimSetup(load_profile(H200), w.hbm_kv_gib, w.dram_kv_gib, b_xfer)
    label = f"{point.trace}:{point.knob}={point.value}"
    return SweepJob(
        str(w.path), RATES[w.name], duration_s, policy, knobs, setup, label=label,
        horizon_s=horizon_s(duration_s),
    )  # fmt: skip


def plan(workloads: Sequence[Workload]) -> list[Point]:
    points = []
    for w in workloads:
        points += [Point(w.name, "vllm", None), Point(w.name, "default", None)]
        points += [Point(w.name, k, v) for k, values in SWEEPS.items() for v in values]
    return points


def best_value(rows: Sequence[dict[str, Any]]) -> float:
    """The swept value with the best goodput (then TTFT attainment)."""
    top = max(rows, key=lambda r: (round(r["goodput_rps"], 3), r["ttft_attainment"]))
    return float(top["value"])


def summarize(rows: Sequence[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"wall_s": round(wall_s, 1), "runs": len(rows)}
    for trace in RATES:
        mine = [r for r in rows if r["trace"] == trace]
        if not mine:
            continue
        for ref in ("default", "vllm"):
            (row,) = [r for r in mine if r["knob"] == ref]
            out[f"{trace}_{ref}_ttft"] = round(row["ttft_attainment"], 3)
            out[f"{trace}_{ref}_tbt"] = round(row["tbt_attainment"], 3)
        for knob in SWEEPS:
            out[f"{trace}_{knob}_best"] = best_value([r for r in mine if r["knob"] == knob])
    return out


def result_line(summary: dict[str, Any]) -> str:
    return "RESULT tuning_curves " + " ".join(f"{k}={v}" for k, v in summary.items())


def print_tables(rows: Sequence[dict[str, Any]]) -> None:
    for trace, rps in RATES.items():
        print(f"\n{trace} at {rps:g} req/s (h200-llama3-8b)")
        print(f"{'knob':>16} {'value':>7} {'TTFT %':>7} {'TBT %':>6} {'goodput':>8} {'rot':>6}")
        for r in (r for r in rows if r["trace"] == trace):
            value = "-" if r["value"] is None else f"{r['value']:g}"
            print(
                f"{r['knob']:>16} {value:>7} {100 * r['ttft_attainment']:7.1f} "
                f"{100 * r['tbt_attainment']:6.1f} {r['goodput_rps']:8.2f} {r['rotations']:6d}"
            )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--traces-dir", type=Path, default=TRACES)
    parser.add_argument("--trace", action="append", choices=sorted(RATES), default=None)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "tuning_curves.png")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = set(args.trace or RATES)
    workloads = [w for w in kit_workloads(args.traces_dir) if w.name in chosen]
    points = plan(workloads)
    by_name = {w.name: w for w in workloads}
    jobs = [job_for(by_name[p.trace], p, args.duration) for p in points]
    start = time.perf_counter()
    results = run_sweep(jobs, args.workers)
    wall_s = time.perf_counter() - start
    rows = [
        {"trace": p.trace, "knob": p.knob, "value": p.value, **row}
        for p, (row, _) in zip(points, results, strict=True)
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    config = {"duration_s": args.duration, "rates": RATES, "profile": H200, "sweeps": SWEEPS}
    payload = {"config": config, "rows": rows}
    (args.out / "tuning_curves.json").write_text(json.dumps(payload, indent=1) + "\n")
    print_tables(rows)
    from bench.tuning_plot import plot_curves

    plot_curves(rows, args.plot, SWEEPS, DEFAULTS)
    print(f"figure: {args.plot}")
    print(result_line(summarize(rows, wall_s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
