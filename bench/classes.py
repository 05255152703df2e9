"""Mixed SLO classes under LVF, in virtual time (the real engine and policy on the cost model,
lab/sim): does a tight class keep its attainment when a loose class floods the server?

What runs: per kit trace (lengths; Mooncake keeps its hash ids), 20 % of the requests
interactive (TTFT SLO 2 s), 80 % batch (TTFT SLO 30 s), Poisson at 1.0x and 1.5x vllm's knee
for the trace (bench/sched_compare.py's table), 40 s of arrivals on the h200-llama3-8b profile
with sched_compare's pools (DRAM 8x). Per trace, rate and seed (``--seeds``, default 5), LVF
runs on the same arrivals:

- ``vlt``: ``deadline_lag`` and ``residency_yields_to_tighter`` off (SUPERINFER.md §3's lag in
  seconds: a batch request 10 s past its 15 s tolerance outranks an interactive one 0.5 s
  past its 1 s; LVF before these knobs);
- ``deadline``: the defaults (``deadline_lag`` on: waiting requests and prefill chunks by
  deadline across classes; ``residency_yields_to_tighter`` on: a lagging tighter class may
  rotate a looser one out inside its residency);
- ``late``: ``deadline_lag`` and ``demote_late_s`` 0 (a waiting request whose TTFT is already
  missed goes after every request that can still make it, within free HBM);
- ``alone``: the interactive requests only, defaults (what the class gets without the flood).

Reported per trace and rate: interactive TTFT attainment of each run and its difference to
``alone`` (points), batch goodput (requests meeting TTFT and TPOT per second of arrivals),
total goodput, the share of requests that started late by more than ``demote_late_s`` (the
demoted ones, counted as missed like every late request) and their TTFT p50. Means over seeds
with percentile-bootstrap 95 % intervals (lab/stats.py). Judgment per (trace, rate) (the
issue's): ``deadline``'s interactive attainment not below ``alone``'s (the difference's
interval reaches 0); batch's goodput is reported beside it, not judged.

The last line: ``RESULT classes interactive_delta_pts=... interactive_delta_pts_vlt=...
batch_goodput_ratio=... batch_goodput_ratio_late=... demoted_share_late=...`` (worst over the
traces and rates; the gains with ``_lo``/``_hi``).

    .venv/bin/python bench/classes.py [--seeds 5] [--workers 2] [--traces sharegpt,arxiv]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fairness_measure import TenantRun
from bench.sched_compare import Workload, kit_workloads
from lab.costmodel import load_profile
from lab.sim.setup import SimSetup
from lab.sim.simulator import run_simulation
from lab.stats import Interval, mean_interval, ratio_interval
from lab.traces import TraceRequest, load_trace
from shared.policy import Knobs

REPO = Path(__file__).resolve().parents[1]
TRACES_DIR = REPO.parent / "shared" / "traces"
PROFILE = "h200-llama3-8b"
DRAM_PER_HBM = 8.0
RATE_FACTORS = (1.0, 1.5)
INTERACTIVE, BATCH = "interactive", "batch"
INTERACTIVE_TTFT_S, BATCH_TTFT_S, INTERACTIVE_SHARE = 2.0, 30.0, 0.2
LATE_S = 0.0
VARIANTS: dict[str, dict[str, Any]] = {
    "vlt": {"deadline_lag": False, "residency_yields_to_tighter": False},
    "deadline": {},
    "late": {"demote_late_s": LATE_S},
    "alone": {},
}

Job = tuple[str, list[TraceRequest], dict[str, Any], float, float]


def mixed_trace(workload: Workload, rps: float, duration_s: float, seed: int) -> list[TraceRequest]:
    """Arrivals at ``rps``: ``INTERACTIVE_SHARE`` interactive (TTFT SLO 2 s), the rest batch
    (30 s); the class is also the request's tenant label (for per-class figures)."""
    reqs = load_trace(
        str(workload.path), rps=rps, duration_s=duration_s, num_requests=None, seed=seed
    )
    fast = np.random.default_rng(seed + 2_000_003).random(len(reqs)) < INTERACTIVE_SHARE
    return [
        dataclasses.replace(
            r,
            tenant=INTERACTIVE if f else BATCH,
            slo_ttft_s=INTERACTIVE_TTFT_S if f else BATCH_TTFT_S,
        )
        for r, f in zip(reqs, fast, strict=True)
    ]


def simulate(job: Job) -> tuple[TenantRun, float]:
    """One LVF run; the per-class figures and the TTFT p50 of the requests that started late
    by more than ``LATE_S`` (NaN when none did)."""
    label, trace, overrides, hbm_gib, duration_s = job
    setup = SimSetup(load_profile(PROFILE), hbm_gib, DRAM_PER_HBM * hbm_gib, "auto")
    knobs = Knobs(policy="lvf", **overrides)
    result = run_simulation(trace, "lvf", knobs, setup, horizon_s=max(3 * duration_s, 120.0))
    run = TenantRun.of(label, trace, result.timelines, result.row, duration_s)
    late = [
        t.token_times_s[0] - t.arrival_s if t.token_times_s else np.inf
        for t in result.timelines
        if not t.token_times_s or t.token_times_s[0] - t.arrival_s > t.slo_ttft_s + LATE_S
    ]
    share = len(late) / max(1, len(result.timelines))
    return dataclasses.replace(run, row=run.row | {"late_share": share}), (
        float(np.median(late)) if late else float("nan")
    )


def plan(args: argparse.Namespace, workloads: Sequence[Workload]) -> list[Job]:
    jobs: list[Job] = []
    for w in workloads:
        for factor in args.rates:
            for seed in range(args.seed, args.seed + args.seeds):
                trace = mixed_trace(w, factor * w.knees[PROFILE], args.duration, seed)
                for variant, overrides in VARIANTS.items():
                    reqs = (
                        [r for r in trace if r.tenant == INTERACTIVE]
                        if variant == "alone"
                        else trace
                    )
                    label = f"{w.name} {factor:g}x {variant} s{seed}"
                    jobs.append((label, reqs, overrides, w.hbm_kv_gib, args.duration))
    return jobs


def run_all(jobs: Sequence[Job], workers: int) -> dict[str, tuple[TenantRun, float]]:
    if workers <= 1:
        done = [simulate(job) for job in jobs]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            done = list(pool.map(simulate, jobs))
    for run, late_p50 in done:
        print(f"  {run.label:34s} {run.summary()} late p50 {late_p50:.1f} s", flush=True)
    return {run.label: (run, late_p50) for run, late_p50 in done}


def judge(runs: dict[str, tuple[TenantRun, float]], key: str, seeds: Sequence[int]) -> dict:
    """One (trace, rate)'s figures over the seeds (``key``: "<trace> <factor>x")."""
    by = {v: [runs[f"{key} {v} s{s}"][0] for s in seeds] for v in VARIANTS}

    def delta(variant: str) -> Interval:
        pairs = zip(by[variant], by["alone"], strict=True)
        return mean_interval(
            [100 * (r.attainment(INTERACTIVE) - a.attainment(INTERACTIVE)) for r, a in pairs]
        )

    def batch(variant: str) -> list[float]:
        return [r.goodput(BATCH) for r in by[variant]]

    def total(variant: str) -> list[float]:
        return [float(r.row["goodput_rps"]) for r in by[variant]]

    late_p50 = [runs[f"{key} late s{s}"][1] for s in seeds]
    return {
        **{
            f"interactive_{v}": mean_interval([r.attainment(INTERACTIVE) for r in by[v]])
            for v in VARIANTS
        },
        "interactive_delta_pts": delta("deadline"),
        "interactive_delta_pts_vlt": delta("vlt"),
        "interactive_delta_pts_late": delta("late"),
        "batch_goodput_vlt": mean_interval(batch("vlt")),
        "batch_goodput_ratio": ratio_interval(batch("deadline"), batch("vlt")),
        "batch_goodput_ratio_late": ratio_interval(batch("late"), batch("vlt")),
        "goodput_ratio": ratio_interval(total("deadline"), total("vlt")),
        "demoted_share_late": mean_interval([r.row["late_share"] for r in by["late"]]),
        "demoted_ttft_p50_s": mean_interval([x for x in late_p50 if np.isfinite(x)] or [0.0]),
    }


def _iv(x: Interval) -> str:
    return f"{x.value:.3f} [{x.lo:.3f}, {x.hi:.3f}]"


def report(figures: dict[str, dict[str, Interval]]) -> dict[str, float]:
    """Print each (trace, rate)'s figures and verdict; the worst of each headline field."""
    for key, f in figures.items():
        print(f"\n== {key}")
        for name, value in f.items():
            print(f"  {name:28s} {_iv(value)}")
        passed = f["interactive_delta_pts"].hi >= 0.0
        print(
            f"{'PASS' if passed else 'FAIL'} {key}: interactive "
            f"{f['interactive_delta_pts'].value:+.1f} pts vs alone (vlt "
            f"{f['interactive_delta_pts_vlt'].value:+.1f}); batch goodput "
            f"{f['batch_goodput_ratio'].value:.3f}x vlt's, all {f['goodput_ratio'].value:.3f}x"
        )
    out: dict[str, float] = {}
    for name in (
        "interactive_delta_pts",
        "interactive_delta_pts_vlt",
        "batch_goodput_ratio",
        "goodput_ratio",
        "batch_goodput_ratio_late",
    ):
        worst = min((f[name] for f in figures.values()), key=lambda i: i.value)
        out |= worst.fields(name) if name != "interactive_delta_pts_vlt" else {name: worst.value}
    out["demoted_share_late"] = max(f["demoted_share_late"].value for f in figures.values())
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--traces", default="sharegpt,azure-code,mooncake,arxiv", help="kit trace names")
    add("--traces-dir", type=Path, default=TRACES_DIR)
    add("--rates", default=",".join(f"{f:g}" for f in RATE_FACTORS), help="x vllm's knee")
    add("--duration", type=float, default=40.0, help="seconds of arrivals")
    add("--seeds", type=int, default=5)
    add("--seed", type=int, default=0)
    add("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        args.rates = [float(x) for x in args.rates.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--rates: comma-separated numbers, got {args.rates!r}")
    if args.seeds < 1 or args.duration <= 0 or not args.rates or min(args.rates) <= 0:
        parser.error("--seeds >= 1, --duration > 0 and --rates > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    known = {w.name: w for w in kit_workloads(args.traces_dir)}
    names = [n.strip() for n in args.traces.split(",") if n.strip()]
    if unknown := [n for n in names if n not in known]:
        print(f"unknown traces {unknown}; known: {sorted(known)}", file=sys.stderr)
        return 2
    if missing := [n for n in names if not known[n].path.is_file()]:
        print(f"SKIP: kit traces not found in {args.traces_dir}: {missing}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    jobs = plan(args, [known[n] for n in names])
    print(f"{len(jobs)} LVF runs, {args.seeds} seeds, {args.duration:g} s of arrivals")
    runs = run_all(jobs, args.workers)
    seeds = range(args.seed, args.seed + args.seeds)
    keys = [f"{n} {f:g}x" for n in names for f in args.rates]
    summary = report({key: judge(runs, key, seeds) for key in keys})
    print(f"\nwall {time.perf_counter() - t0:.0f} s")
    print("RESULT classes " + " ".join(f"{k}={v:.3f}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
