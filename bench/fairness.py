"""Per-tenant fairness inside LVF, in virtual time (the real engine and policy on the cost
model, lab/sim): can one tenant that floods the server push the others past their SLO?

What runs: eight tenants in one SLO class send ShareGPT-8k-length requests (Poisson), tenant
``heavy`` at 8x the rate of each of the seven others (``t1`` .. ``t7``); 40 s of arrivals on
the h200-llama3-8b profile with the kit's ShareGPT pools (16 GiB HBM, DRAM 8x), at 1.0x and
1.5x vllm's knee there (8.9 req/s, bench/sched_compare.py's table). Per rate and seed
(``--seeds``, default 5), three LVF runs on the same arrivals: fairness off (``tenant_fairness``
False, the paper's LVF with our defaults), fairness on, and the light tenants alone (the heavy
tenant's requests removed: what they would get without it). (Mixed SLO classes, a tight one
under a loose one's flood: bench/classes.py.)

Fairness measure (VTC's): each tenant's service in the arrival window (prompt tokens of the
requests whose first token came before its end, output tokens produced before it) over its
max-min fair share of the window's total service (water-filling over the tenants' demands: a
light tenant demands what it got alone, the heavy one the tokens it asked for in the window);
Jain's index of those ratios, 1.0 when every tenant gets its fair share. Judgment: Jain >=
0.9 with fairness; the light tenants' TTFT attainment within 5 points of their run alone;
total goodput >= 0.95x fairness off. Means over seeds with percentile-bootstrap 95 %
intervals (lab/stats.py); a judgment passes when its whole interval does.

Also printed per seed and in the RESULT (``light_entitled``): the share of what the light
tenants got alone that max-min fairness entitles them to beside the heavy tenant (1.0: all of
it). Where it is under 1.0 the light tenants alone already need more than an equal share of
the window's service, and holding them to their attainment alone would take service from the
heavy tenant below its fair share: that seed's light-tenant judgment asks for unfairness.

The last line: ``RESULT fairness jain=... jain_unfair=... light_ttft_delta_pts=...
goodput_ratio=... light_entitled=...`` (worst over the two rates, each with ``_lo``/``_hi``).

    .venv/bin/python bench/fairness.py [--seeds 5] [--workers 2] [--duration 40]
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

from bench.fairness_measure import (
    TenantRun,
    jain,
    light_attainment,
    light_entitlement,
    tenant_shares,
)
from lab.costmodel import load_profile
from lab.sim.setup import SimSetup
from lab.sim.simulator import run_simulation
from lab.stats import Interval, mean_interval, ratio_interval
from lab.traces import TraceRequest, load_trace
from shared.policy import Knobs

REPO = Path(__file__).resolve().parents[1]
SHAREGPT = REPO.parent / "shared" / "traces" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
PROFILE = "h200-llama3-8b"
HBM_GIB, DRAM_GIB = 16.0, 128.0
KNEE_RPS = 8.9  # vllm's 50 % TTFT rate there (bench/sched_compare.py)
RATE_FACTORS = (1.0, 1.5)
HEAVY, HEAVY_WEIGHT, NUM_LIGHT = "heavy", 8, 7
MIN_JAIN, MAX_LIGHT_LOSS_PTS, MIN_GOODPUT_RATIO = 0.9, 5.0, 0.95


def tenant_trace(path: Path, rps: float, duration_s: float, seed: int) -> list[TraceRequest]:
    """Poisson arrivals at ``rps``, each request a tenant's: ``heavy`` with weight 8, the
    seven light ones 1 each (independent Poisson streams by thinning), sorted by arrival."""
    reqs = load_trace(str(path), rps=rps, duration_s=duration_s, num_requests=None, seed=seed)
    names = [HEAVY] + [f"t{i}" for i in range(1, NUM_LIGHT + 1)]
    weights = np.array([HEAVY_WEIGHT] + [1] * NUM_LIGHT, dtype=np.float64)
    picks = np.random.default_rng(seed + 1_000_003).choice(
        len(names), size=len(reqs), p=weights / weights.sum()
    )
    out = [dataclasses.replace(r, tenant=names[int(i)]) for r, i in zip(reqs, picks, strict=True)]
    return sorted(out, key=lambda r: r.arrival_s)


def simulate(job: tuple[str, list[TraceRequest], bool, float]) -> TenantRun:
    """One LVF run of ``trace`` (fairness on or off); the per-tenant figures of the window."""
    label, trace, fair, duration_s = job
    setup = SimSetup(load_profile(PROFILE), HBM_GIB, DRAM_GIB, "auto")
    knobs = Knobs(policy="lvf", tenant_fairness=fair)
    result = run_simulation(trace, "lvf", knobs, setup, horizon_s=max(3 * duration_s, 120.0))
    return TenantRun.of(label, trace, result.timelines, result.row, duration_s)


def plan(args: argparse.Namespace) -> list[tuple[str, list[TraceRequest], bool, float]]:
    jobs = []
    for factor in RATE_FACTORS:
        for seed in range(args.seed, args.seed + args.seeds):
            trace = tenant_trace(args.trace, factor * args.knee, args.duration, seed)
            light = [r for r in trace if r.tenant != HEAVY]
            jobs += [
                (f"unfair {factor:g}x s{seed}", trace, False, args.duration),
                (f"fair {factor:g}x s{seed}", trace, True, args.duration),
                (f"alone {factor:g}x s{seed}", light, True, args.duration),
            ]
    return jobs


def run_all(jobs: Sequence[tuple[str, list[TraceRequest], bool, float]], workers: int) -> dict:
    if workers <= 1:
        runs = [simulate(job) for job in jobs]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            runs = list(pool.map(simulate, jobs))
    for run in runs:
        print(f"  {run.label:22s} {run.summary()}", flush=True)
    return {run.label: run for run in runs}


def judge_rate(runs: dict[str, TenantRun], factor: float, seeds: Sequence[int]) -> dict:
    """The rate's figures over the seeds: Jain with and without fairness, the light tenants'
    TTFT loss against their run alone, the goodput ratio."""
    tag = f"{factor:g}x"
    unfair = [runs[f"unfair {tag} s{s}"] for s in seeds]
    fair = [runs[f"fair {tag} s{s}"] for s in seeds]
    alone = [runs[f"alone {tag} s{s}"] for s in seeds]
    deltas = [
        100 * (light_attainment(f) - light_attainment(a)) for f, a in zip(fair, alone, strict=True)
    ]
    for seed, delta, f, a in zip(seeds, deltas, fair, alone, strict=True):
        print(
            f"  {tag} seed {seed}: light tenants {delta:+.1f} pts vs alone; max-min fairness "
            f"entitles them to {light_entitlement(f, a):.3f} of what they got alone"
        )
    return {
        "jain": mean_interval(
            [jain(tenant_shares(r, a)) for r, a in zip(fair, alone, strict=True)]
        ),
        "jain_unfair": mean_interval(
            [jain(tenant_shares(r, a)) for r, a in zip(unfair, alone, strict=True)]
        ),
        "light_ttft_delta_pts": mean_interval(deltas),
        "light_entitled": mean_interval(
            [light_entitlement(f, a) for f, a in zip(fair, alone, strict=True)]
        ),
        "goodput_ratio": ratio_interval(
            [r.row["goodput_rps"] for r in fair], [r.row["goodput_rps"] for r in unfair]
        ),
        "heavy_ttft": mean_interval([r.attainment(HEAVY) for r in fair]),
        "heavy_ttft_unfair": mean_interval([r.attainment(HEAVY) for r in unfair]),
        "light_ttft_unfair": mean_interval([light_attainment(r) for r in unfair]),
        "light_ttft_alone": mean_interval([light_attainment(r) for r in alone]),
    }


def _iv(x: Interval, fmt: str = ".3f") -> str:
    return f"{x.value:{fmt}} [{x.lo:{fmt}}, {x.hi:{fmt}}]"


def report(by_rate: dict[float, dict]) -> dict[str, float]:
    for factor, f in by_rate.items():
        print(f"\n== {factor:g}x the knee ({factor * KNEE_RPS:.3g} req/s)")
        for key, value in f.items():
            print(f"  {key:22s} {_iv(value)}")
        passed = (
            f["jain"].above(MIN_JAIN)
            and f["light_ttft_delta_pts"].above(-MAX_LIGHT_LOSS_PTS)
            and f["goodput_ratio"].above(MIN_GOODPUT_RATIO)
        )
        print(
            f"{'PASS' if passed else 'FAIL'} at {factor:g}x: Jain {f['jain'].value:.3f} (need >= "
            f"{MIN_JAIN:g} over the interval), light tenants {f['light_ttft_delta_pts'].value:+.1f}"
            f" pts vs alone (need >= -{MAX_LIGHT_LOSS_PTS:g}), goodput "
            f"{f['goodput_ratio'].value:.3f}x (need >= {MIN_GOODPUT_RATIO:g})"
        )
    worst = min(by_rate.values(), key=lambda f: f["jain"].value)
    out: dict[str, float] = {}
    out |= worst["jain"].fields("jain")
    out |= min((f["jain_unfair"] for f in by_rate.values()), key=lambda i: i.value).fields(
        "jain_unfair"
    )
    out |= min((f["light_ttft_delta_pts"] for f in by_rate.values()), key=lambda i: i.value).fields(
        "light_ttft_delta_pts"
    )
    out |= min((f["goodput_ratio"] for f in by_rate.values()), key=lambda i: i.value).fields(
        "goodput_ratio"
    )
    out |= min((f["light_entitled"] for f in by_rate.values()), key=lambda i: i.value).fields(
        "light_entitled"
    )
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--trace", type=Path, default=SHAREGPT, help="a length-stats trace (default ShareGPT)")
    add("--knee", type=float, default=KNEE_RPS, help="vllm's knee for the trace (req/s)")
    add("--duration", type=float, default=40.0, help="seconds of arrivals")
    add("--seeds", type=int, default=5)
    add("--seed", type=int, default=0)
    add("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.duration <= 0 or args.knee <= 0:
        parser.error("--seeds >= 1, --duration > 0 and --knee > 0")
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace}: no such file")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    jobs = plan(args)
    print(f"{len(jobs)} LVF runs, {args.seeds} seeds, {args.duration:g} s of arrivals")
    runs = run_all(jobs, args.workers)
    seeds = range(args.seed, args.seed + args.seeds)
    by_rate = {factor: judge_rate(runs, factor, seeds) for factor in RATE_FACTORS}
    summary = report(by_rate)
    print(f"\nwall {time.perf_counter() - t0:.0f} s")
    fields: list[Any] = [f"{k}={v:.3f}" for k, v in summary.items()]
    print("RESULT fairness " + " ".join(fields))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
