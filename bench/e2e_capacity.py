"""SLO capacity of vllm and lvf served on CPU, next to the simulator's for the same setup: does
the served ordering (lvf's capacity above vllm's) agree with the simulator's?

SLO capacity: the highest request rate at which >= 90 % of requests meet both their TTFT and
their TPOT SLO (DistServe's goodput; ``superinfer bench --capacity``). The setup is
bench/e2e_compare.py's (``superinfer serve`` with a small model and KV pools sized so that
requests contend for HBM, one SLO class, the policy switched through ``PUT /admin/v1/knobs``,
the worker on one torch thread, a CPU cost profile fitted by ``superinfer profile`` and
calibrated for the serving loop before and after the served runs). Served: for each policy
and each of ``--seeds`` seeds of arrivals a crossing search (lab/crossing.py) whose every probe
is a whole ``superinfer bench`` run of ``--probe-duration`` seconds at the rate it picks, from
``--rps``; the searches advance in lock step, seed by seed, vllm and lvf alternated (A, B, B,
A, ...), the load average printed with each probe. Simulated: the same searches over the
simulator with each calibrated profile. The same trace and seeds everywhere.

    .venv/bin/python bench/e2e_capacity.py [--seeds 3 --rps 3.5 --probe-duration 20 ...] [--out DIR]

Ends with ``RESULT e2e_capacity served_vllm=... served_lvf=... served_ratio=... (with _lo/_hi)
sim_ratio=... sim_ratio_after=... served_side=... agree=...``: each ratio is the sum of lvf's
capacities over the seeds / vllm's with a bootstrap 95 % interval paired by seed; its side is
+1 when the whole interval lies above 1.0, -1 below, 0 when it holds 1.0 (``served_side``);
``agree``: served and both simulations on the same side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

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
    gauges,
    sim_setup,
    start_server,
    switch_policy,
)
from lab.costmodel import load_profile  # noqa: E402
from lab.crossing import CAPACITY_METRIC, CAPACITY_TARGET, CrossingSearch  # noqa: E402
from lab.sim.sweep import SweepJob, run_sweep  # noqa: E402
from lab.stats import Interval, mean_interval, ratio_interval  # noqa: E402
from shared.policy import Knobs  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    add = parser.add_argument
    add("--probe-duration", type=float, default=20.0, help="seconds of arrivals per probe")
    add("--capacity-tol", type=float, default=1.25, help="stop when hi/lo <= this")
    add("--seeds", type=int, default=3, help="seeds of arrivals per policy (searched apart)")
    return parser.parse_args()


Key = tuple[str, int]  # policy, seed


def lockstep(
    args: argparse.Namespace, metric_at: Callable[[str, int, float], float], label: str
) -> dict[Key, CrossingSearch]:
    """One crossing search of ``CAPACITY_TARGET`` per policy and seed, advanced in lock step:
    each round probes every unfinished search once (``metric_at(policy, seed, rate)``), seed
    by seed, the policies' order reversed every other probe (A, B, B, A, ...) so that a drift
    of the host's load falls on both."""
    keys = [(policy, seed) for seed in seeds(args) for policy in POLICIES]
    found = {key: CrossingSearch(args.rps, CAPACITY_TARGET, tol=args.capacity_tol) for key in keys}
    turn = 0
    while True:
        todo = [(key, rate) for key in keys if (rate := found[key].next_rate()) is not None]
        if not todo:
            return found
        pairs = [todo[i : i + 2] for i in range(0, len(todo), 2)]
        for pair in pairs:
            for (policy, seed), rate in pair if turn % 2 == 0 else pair[::-1]:
                value = metric_at(policy, seed, rate)
                found[(policy, seed)].probes.append((rate, value))
                print(
                    f"  {label} {policy:5s} seed {seed} {rate:7.3f} req/s: "
                    f"{100 * value:5.1f} % within both (load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
            turn += 1


SAMPLED = ("superinfer:b_xfer_blocks", "superinfer:link_bytes_per_s")


@contextmanager
def sampled(url: str, into: dict[str, list[float]], period_s: float = 1.0) -> Iterator[None]:
    """Poll the worker's B_xfer in force and measured link bandwidth from /metrics every
    ``period_s`` while the block runs (what ``auto`` resolved to under the probe's load)."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(period_s):
            try:
                now = gauges(url)
            except Exception:  # a missed sample, never a failed probe
                continue
            for name in SAMPLED:
                if name in now:
                    into.setdefault(name, []).append(now[name])

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def seeds(args: argparse.Namespace) -> list[int]:
    return list(range(args.seed, args.seed + args.seeds))


def served_capacity(
    args: argparse.Namespace, out: Path, engine_profile: Path
) -> tuple[dict[Key, CrossingSearch], dict[str, Path]]:
    url = f"http://127.0.0.1:{args.port}"
    server = start_server(args, out / "serve.log")
    try:
        admin_put(url, "slo-classes", {SLO_CLASS: {"ttft_s": args.ttft_slo, "tbt_s": args.tbt_slo}})
        admin_put(url, "knobs", {"b_xfer": args.b_xfer or "auto"})
        bench(args, url, None, 4)  # warm-up: first-call costs of torch, the gateway, Redis
        profiles = {"before": calibrate(args, url, engine_profile, out, "before")[0]}
        current = [""]

        def probe(policy: str, seed: int, rate: float) -> float:
            if policy != current[0]:
                switch_policy(url, policy)
                current[0] = policy
            at = argparse.Namespace(
                **{**vars(args), "rps": rate, "duration": args.probe_duration, "seed": seed}
            )
            samples: dict[str, list[float]] = {}
            with sampled(url, samples):
                row = bench(at, url, None, None)["results"][0]
            b_xfer, link = (samples.get(name) or [0.0] for name in SAMPLED)
            print(
                f"    B_xfer in force: median {statistics.median(b_xfer):.0f} blocks "
                f"(min {min(b_xfer):.0f}), link {statistics.median(link) / 1e9:.2f} GB/s",
                flush=True,
            )
            return float(row[CAPACITY_METRIC] or 0.0)

        found = lockstep(args, probe, "served")
        profiles["after"] = calibrate(args, url, engine_profile, out, "after")[0]
        return found, profiles
    finally:
        server.terminate()
        server.wait(timeout=60)


def simulated_capacity(
    args: argparse.Namespace, profile: Path, tag: str
) -> dict[Key, CrossingSearch]:
    setup = sim_setup(args, load_profile(profile))
    knobs = Knobs(slo_ttft_s=args.ttft_slo, slo_tbt_s=args.tbt_slo)

    def probe(policy: str, seed: int, rate: float) -> float:
        job = SweepJob(
            args.trace, rate, args.probe_duration, policy, knobs, setup, args.burstiness, seed
        )
        ((row, _),) = run_sweep([job])
        return float(row[CAPACITY_METRIC])

    return lockstep(args, probe, f"sim ({tag})")


def by_policy(found: dict[Key, CrossingSearch]) -> dict[str, list[float]]:
    """Each policy's capacity per seed (req/s, seeds in order)."""
    out: dict[str, list[float]] = {}
    for (policy, _), search in found.items():
        out.setdefault(policy, []).append(search.capacity())
    return out


def ratio(found: dict[Key, CrossingSearch]) -> Interval:
    """lvf / vllm: the sum of lvf's capacities over the seeds / vllm's, with a bootstrap 95 %
    interval paired by seed."""
    caps = by_policy(found)
    return ratio_interval(caps["lvf"], caps["vllm"])


def side(value: Interval) -> int:
    """+1 when the ratio's whole interval lies above 1.0, -1 below, 0 when it holds 1.0."""
    return 1 if value.lo > 1.0 else (-1 if value.hi < 1.0 else 0)


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
        name: {
            f"{policy} s{seed}": {"capacity_rps": s.capacity(), "probes": s.probes}
            for (policy, seed), s in found.items()
        }
        for name, found in sources.items()
    }
    (out / "e2e_capacity.json").write_text(
        json.dumps({"args": vars(args), **document}, indent=2) + "\n", encoding="utf-8"
    )
    for name, found in sources.items():
        caps = by_policy(found)
        parts = [f"{p} {mean_interval(caps[p]).value:.3f} ({_seeds(caps[p])})" for p in POLICIES]
        r = ratio(found)
        print(
            f"{name:12s} req/s: {'  '.join(parts)}  lvf/vllm {r.value:.3f} [{r.lo:.3f}, {r.hi:.3f}]"
        )
    sides = {name: side(ratio(found)) for name, found in sources.items()}
    print(f"outputs in {out}; host load average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    served_caps = by_policy(served)
    fields = {
        "served_vllm": mean_interval(served_caps["vllm"]).value,
        "served_lvf": mean_interval(served_caps["lvf"]).value,
        **ratio(served).fields("served_ratio"),
        **ratio(sims["before"]).fields("sim_ratio"),
        **ratio(sims["after"]).fields("sim_ratio_after"),
        "served_side": sides["served"],
        "agree": int(len(set(sides.values())) == 1),
    }
    print(
        "RESULT e2e_capacity "
        + " ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
        )
    )
    return 0


def _seeds(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


if __name__ == "__main__":
    raise SystemExit(main())
