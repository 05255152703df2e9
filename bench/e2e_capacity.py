"""SLO capacity of vllm and lvf served on CPU, next to the simulator's for the same setup: does
the served ordering (lvf's capacity above vllm's) agree with the simulator's?

SLO capacity: the highest request rate at which >= 90 % of requests meet both their TTFT and
their TPOT SLO (DistServe's goodput; ``superinfer bench --capacity``). The setup is
bench/e2e_compare.py's (``superinfer serve`` with a small model and KV pools sized so that
requests contend for HBM, one SLO class, the policy switched through ``PUT /admin/v1/knobs``,
the worker on one torch thread, a CPU cost profile fitted by ``superinfer profile`` and
calibrated for the serving loop before and after the served runs). Served: for each policy a
crossing search (lab/crossing.py) whose every probe is a whole ``superinfer bench`` run of
``--probe-duration`` seconds at the rate it picks, from ``--rps``; simulated: the same search
over the simulator with each calibrated profile. The same trace and seed everywhere.

    .venv/bin/python bench/e2e_capacity.py [--rps 3.5 --probe-duration 20 ...] [--out DIR]

Ends with ``RESULT e2e_capacity served_vllm=... served_lvf=... served_ratio=... sim_ratio=...
sim_ratio_after=... agree=...`` (``agree``: lvf/vllm is on the same side of 1.0 served and in
both simulations, or within ``--capacity-tol`` of 1.0 in all).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.e2e_compare import (  # noqa: E402
    POLICIES,
    SLO_CLASS,
    add_arguments,
    admin_put,
    bench,
    calibrate,
    fit_profile,
    sim_setup,
    start_server,
    switch_policy,
)
from lab.costmodel import load_profile  # noqa: E402
from lab.crossing import CAPACITY_METRIC, CAPACITY_TARGET, CrossingSearch  # noqa: E402
from lab.sim.sweep import SweepJob, run_sweep  # noqa: E402
from shared.policy import Knobs  # noqa: E402

Probe = tuple[float, float]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    add = parser.add_argument
    add("--probe-duration", type=float, default=20.0, help="seconds of arrivals per probe")
    add("--capacity-tol", type=float, default=1.25, help="stop when hi/lo <= this")
    return parser.parse_args()


def search(start: float, tol: float, metric_at: Any, label: str) -> CrossingSearch:
    """A crossing search of ``CAPACITY_TARGET`` whose probe at a rate is ``metric_at(rate)``."""
    found = CrossingSearch(start, CAPACITY_TARGET, tol=tol)
    while (rate := found.next_rate()) is not None:
        value = metric_at(rate)
        found.probes.append((rate, value))
        print(f"  {label:28s} {rate:7.3f} req/s: {100 * value:5.1f} % within both", flush=True)
    return found


def served_capacity(
    args: argparse.Namespace, out: Path, engine_profile: Path
) -> tuple[dict[str, CrossingSearch], dict[str, Path]]:
    url = f"http://127.0.0.1:{args.port}"
    server = start_server(args, out / "serve.log")
    try:
        admin_put(url, "slo-classes", {SLO_CLASS: {"ttft_s": args.ttft_slo, "tbt_s": args.tbt_slo}})
        bench(args, url, None, 4)  # warm-up: first-call costs of torch, the gateway, Redis
        profiles = {"before": calibrate(args, url, engine_profile, out, "before")[0]}
        found = {}
        for policy in POLICIES:
            switch_policy(url, policy)

            def probe(rate: float) -> float:
                at = argparse.Namespace(
                    **{**vars(args), "rps": rate, "duration": args.probe_duration}
                )
                row = bench(at, url, None, None)["results"][0]
                return float(row[CAPACITY_METRIC] or 0.0)

            found[policy] = search(args.rps, args.capacity_tol, probe, f"served {policy}")
        profiles["after"] = calibrate(args, url, engine_profile, out, "after")[0]
        return found, profiles
    finally:
        server.terminate()
        server.wait(timeout=60)


def simulated_capacity(args: argparse.Namespace, profile: Path, tag: str) -> dict[str, Any]:
    setup = sim_setup(args, load_profile(profile))
    knobs = Knobs(slo_ttft_s=args.ttft_slo, slo_tbt_s=args.tbt_slo)
    found = {}
    for policy in POLICIES:

        def probe(rate: float, policy: str = policy) -> float:
            job = SweepJob(
                args.trace, rate, args.probe_duration, policy, knobs, setup, args.burstiness,
                args.seed,
            )  # fmt: skip
            ((row, _),) = run_sweep([job])
            return float(row[CAPACITY_METRIC])

        found[policy] = search(args.rps, args.capacity_tol, probe, f"sim ({tag}) {policy}")
    return found


def ratio(found: dict[str, CrossingSearch]) -> float:
    vllm = found["vllm"].capacity()
    return found["lvf"].capacity() / vllm if vllm > 0 else float("inf")


def side(value: float, tol: float) -> int:
    """+1 above 1.0, -1 below, 0 within ``tol`` of it (a tie at the search's resolution)."""
    return 0 if 1 / tol <= value <= tol else (1 if value > 1 else -1)


def main() -> int:
    args = parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="e2e-capacity-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"host load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    engine_profile = Path(args.profile) if args.profile else fit_profile(args, out)
    served, profiles = served_capacity(args, out, engine_profile)
    sims = {tag: simulated_capacity(args, path, tag) for tag, path in profiles.items()}
    sources = {"served": served, **{f"sim ({tag})": found for tag, found in sims.items()}}
    document = {
        name: {p: {"capacity_rps": s.capacity(), "probes": s.probes} for p, s in found.items()}
        for name, found in sources.items()
    }
    (out / "e2e_capacity.json").write_text(
        json.dumps({"args": vars(args), **document}, indent=2) + "\n", encoding="utf-8"
    )
    for name, found in sources.items():
        caps = "  ".join(f"{p} {found[p].capacity():.3f}" for p in POLICIES)
        print(f"{name:16s} capacity req/s: {caps}  lvf/vllm {ratio(found):.3f}")
    sides = {side(ratio(found), args.capacity_tol) for found in sources.values()}
    agree = len(sides) == 1
    print(f"outputs in {out}; host load average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    print(
        "RESULT e2e_capacity"
        f" served_vllm={served['vllm'].capacity():.3f} served_lvf={served['lvf'].capacity():.3f}"
        f" served_ratio={ratio(served):.3f} sim_ratio={ratio(sims['before']):.3f}"
        f" sim_ratio_after={ratio(sims['after']):.3f} agree={int(agree)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
