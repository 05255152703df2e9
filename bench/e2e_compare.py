"""vllm vs lvf end to end on CPU, next to the simulator's prediction for the same setup.

Starts ``superinfer serve`` (gateway, control plane, one worker, embedded Redis) with a small
model and KV pools sized so that requests contend for HBM, sets the SLO class the requests use
(``PUT /admin/v1/slo-classes``), then replays one trace with ``superinfer bench`` under policy
``vllm`` and again under ``lvf``, switching through ``PUT /admin/v1/knobs`` (no restart). The
same trace, pools and SLOs go through ``superinfer simulate``'s engine with a CPU cost profile
fitted on this machine by ``superinfer profile`` (run first unless ``--profile`` is given).
The worker runs on one torch thread (``OMP_NUM_THREADS=1``), as the profile is fitted, so that
the gateway, control plane, Redis and the client have the other core.

    .venv/bin/python bench/e2e_compare.py [--rps 6 --duration 40 ...] [--out DIR]

The serving loop's own cost per iteration (Redis traffic, and the CPU the gateway, control
plane, Redis and client take on a small host) is calibrated from a short served run before and
again after the two runs, so the simulator is run twice, with each calibration; the engine
profile alone is shown too. Ends with ``RESULT e2e_compare ...``: the TTFT-attainment difference
(lvf - vllm, points) end to end and in the simulator (before/after calibrations), the
calibrated overheads, and whether the served difference lies within ``--tolerance-pts`` of the
simulator's range.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lab.costmodel import (  # noqa: E402
    CostProfile,
    kv_block_bytes,
    load_profile,
    profile_to_dict,
)
from lab.loadgen.cli import add_bench_arguments, run_bench  # noqa: E402
from lab.loadgen.report import parse_prometheus  # noqa: E402
from lab.sim.setup import GIB, SimSetup  # noqa: E402
from lab.sim.simulator import run_simulation  # noqa: E402
from lab.sim.sweep import SweepJob, run_sweep  # noqa: E402
from lab.traces import load_trace  # noqa: E402
from shared.policy import Knobs  # noqa: E402

POLICIES = ("vllm", "lvf")
ADMIN_TOKEN = "e2e-compare-admin"
SLO_CLASS = "standard"
SHOWN = (
    ("ttft_attainment", "TTFT att", 100.0),
    ("tbt_attainment", "TBT att", 100.0),
    ("tpot_attainment", "TPOT att", 100.0),
    ("goodput_rps", "goodput", 1.0),
    ("output_tokens_per_s", "tok/s", 1.0),
    ("ttft_p50_s", "TTFT p50 s", 1.0),
    ("ttft_p99_s", "TTFT p99 s", 1.0),
    ("tbt_p99_s", "TBT p99 s", 1.0),
    ("preemptions", "preempt", 1.0),
    ("rotations", "rotations", 1.0),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser.parse_args()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The served setup's flags (bench/e2e_capacity.py takes them too)."""
    add = parser.add_argument
    add("--model", default=str(ROOT.parent / "shared/models/stories260K/stories260K.bin"))
    add("--trace", default="synthetic:96:160")
    add("--rps", type=float, default=3.5)
    add("--burstiness", type=float, default=0.3, help="gamma shape of the gaps (1: Poisson)")
    add("--duration", type=float, default=40.0, help="seconds of arrivals")
    add("--seed", type=int, default=0)
    add("--block-size", type=int, default=16)
    add("--num-hbm-blocks", type=int, default=96)
    add("--num-dram-blocks", type=int, default=2048)
    add("--max-num-seqs", type=int, default=256)
    add("--max-num-batched-tokens", type=int, default=2048)
    add("--ttft-slo", type=float, default=0.5)
    add("--tbt-slo", type=float, default=0.1)
    add("--b-xfer", type=b_xfer_arg, default=None, help="blocks, or auto (default)")
    add("--profile", default=None, help="a fitted profile; default: run superinfer profile")
    add("--tolerance-pts", type=float, default=15.0, help="agreement bound on the delta")
    add("--port", type=int, default=18571)
    add("--out", default=None, help="directory for the JSON files (default: a temp dir)")


def b_xfer_arg(text: str) -> int | None:
    """``--b-xfer``: a number of blocks, or ``auto`` (None)."""
    return None if text.strip().lower() == "auto" else int(text)


def fit_profile(args: argparse.Namespace, out: Path) -> Path:
    path = out / "cpu-profile.json"
    command = [sys.executable, "-m", "superinfer", "profile", "--model", args.model]
    command += ["--threads", "1", "--block-size", str(args.block_size), "--out", str(path)]
    subprocess.run(command, check=True, cwd=ROOT)
    return path


def start_server(args: argparse.Namespace, log_path: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "superinfer", "serve", "--model", args.model]
    command += ["--port", str(args.port), "--policy", "vllm", "--transfer-backend", "cpu"]
    for flag in ("block_size", "num_hbm_blocks", "num_dram_blocks", "max_num_seqs"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    env = {**os.environ, "SUPERINFER_ADMIN_TOKEN": ADMIN_TOKEN, "OMP_NUM_THREADS": "1"}
    log = log_path.open("wb")
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"serve exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise TimeoutError(f"serve not ready after 120 s (log: {log_path})")


def admin_put(url: str, path: str, body: dict[str, Any]) -> None:
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    response = httpx.put(f"{url}/admin/v1/{path}", json=body, headers=headers, timeout=10)
    response.raise_for_status()


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for name, labels, value in parse_prometheus(text):
        if name == "superinfer:policy_info" and value == 1.0:
            out[f"policy={labels.get('policy')}"] = 1.0
        out[name] = out.get(name, 0.0) + value
    return out


def switch_policy(url: str, policy: str) -> None:
    """PUT the knob, then wait until /metrics shows it and the worker is idle."""
    admin_put(url, "knobs", {"policy": policy})
    deadline = time.monotonic() + 60
    busy = ("running", "waiting", "rotary")
    while time.monotonic() < deadline:
        now = gauges(url)
        idle = all(now.get(f"superinfer:num_requests_{b}", 0.0) == 0 for b in busy)
        if now.get(f"policy={policy}") and idle:
            time.sleep(1.0)  # the worker reloads knobs with its heartbeat (0.5 s)
            return
        time.sleep(0.5)
    raise TimeoutError(f"policy {policy} not in effect (or the worker busy) after 60 s")


def bench(args: argparse.Namespace, url: str, json_path: Path | None, num: int | None) -> dict:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    argv = ["--base-url", url, "--trace", args.trace, "--rps", str(args.rps)]
    argv += ["--burstiness", str(args.burstiness)]
    argv += ["--seed", str(args.seed), "--slo-class", SLO_CLASS, "--no-progress"]
    argv += ["--admin-token", ADMIN_TOKEN, "--tokenizer", args.model]
    argv += ["--num-requests", str(num)] if num else ["--duration", str(args.duration)]
    document = run_bench(parser.parse_args(argv)).document
    if json_path is not None:
        json_path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return document


def mean_lengths(args: argparse.Namespace) -> tuple[float, float]:
    trace = load_trace(
        args.trace,
        rps=args.rps,
        duration_s=args.duration,
        num_requests=None,
        burstiness=args.burstiness,
        seed=args.seed,
    )
    return (
        sum(r.input_len for r in trace) / len(trace),
        sum(r.output_len for r in trace) / len(trace),
    )


def calibrate(
    args: argparse.Namespace, url: str, engine_profile: Path, out: Path, tag: str
) -> tuple[Path, float]:
    """The engine profile plus what serving adds per iteration, fitted from one short served
    run: N requests of the trace's lengths, K at a time (K: as many as the HBM pool holds), all
    queued at once, take D seconds through `superinfer serve`; the simulator runs the same
    workload (``max_num_seqs`` = K) with the engine profile in S seconds over I iterations. The
    difference per iteration, (D - S) / I, is added to ``fixed_overhead_s``. It holds the
    worker loop's Redis traffic and the CPU the gateway, control plane, Redis and the client
    take from the worker on this 2-core host. Returns the profile (``cpu-profile-<tag>.json``)
    and the overhead."""
    mean_in, mean_out = mean_lengths(args)
    blocks_per_request = -(-int(mean_in + mean_out) // args.block_size)
    batch = max(1, min(args.max_num_seqs, args.num_hbm_blocks // blocks_per_request))
    num_requests = 4 * batch
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    argv = ["--base-url", url, "--trace", args.trace, "--rps", "1000", "--no-progress"]
    argv += ["--num-requests", str(num_requests), "--max-concurrency", str(batch)]
    argv += ["--tokenizer", args.model, "--seed", str(args.seed + 1)]
    served_s = run_bench(parser.parse_args(argv)).document["results"][0]["duration"]
    profile = load_profile(engine_profile)
    trace = load_trace(
        args.trace, rps=1000.0, duration_s=None, num_requests=num_requests, seed=args.seed + 1
    )
    setup = replace(sim_setup(args, profile), max_num_seqs=batch)
    result = run_simulation(trace, "vllm", Knobs(), setup, rps=1000.0)
    overhead_s = max(0.0, (served_s - result.virtual_s) / max(1, result.num_iterations))
    data = profile_to_dict(profile)
    data["name"] = f"{profile.name}-served-{tag}"
    data["fixed_overhead_s"] = profile.fixed_overhead_s + overhead_s
    data["_sources"]["fixed_overhead_s"] = (
        f"engine fit {profile.fixed_overhead_s:.6g} s + serving {overhead_s:.6g} s per"
        f" iteration: {num_requests} requests ({args.trace}) {batch} at a time took"
        f" {served_s:.2f} s through superinfer serve and {result.virtual_s:.2f} s over"
        f" {result.num_iterations} iterations in the simulator with the engine profile"
    )
    path = out / f"cpu-profile-{tag}.json"
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(
        f"calibration {tag}: {num_requests} requests {batch} at a time: served {served_s:.2f} s,"
        f" simulated {result.virtual_s:.2f} s in {result.num_iterations} iterations ->"
        f" serving adds {1000 * overhead_s:.2f} ms per iteration",
        flush=True,
    )
    return path, overhead_s


def run_served(
    args: argparse.Namespace, out: Path, engine_profile: Path
) -> tuple[dict[str, dict[str, Any]], dict[str, tuple[Path, float]]]:
    """Rows of both policies end to end, and the served profiles calibrated before and after
    them (the host's other load drifts; the two bound what the simulator should see)."""
    url = f"http://127.0.0.1:{args.port}"
    server = start_server(args, out / "serve.log")
    try:
        admin_put(url, "slo-classes", {SLO_CLASS: {"ttft_s": args.ttft_slo, "tbt_s": args.tbt_slo}})
        admin_put(url, "knobs", {"b_xfer": args.b_xfer or "auto"})
        bench(args, url, None, 4)  # warm-up: first-call costs of torch, the gateway, Redis
        calibrated = {"before": calibrate(args, url, engine_profile, out, "before")}
        rows = {}
        for policy in POLICIES:
            switch_policy(url, policy)
            document = bench(args, url, out / f"e2e_{policy}.json", None)
            rows[policy] = document["results"][0]
            print(f"served {policy}: " + summary(rows[policy]), flush=True)
        calibrated["after"] = calibrate(args, url, engine_profile, out, "after")
        return rows, calibrated
    finally:
        server.terminate()
        server.wait(timeout=60)


def sim_setup(args: argparse.Namespace, profile: CostProfile) -> SimSetup:
    """The served pools and limits in the simulator's terms."""
    block_bytes = kv_block_bytes(profile)

    def gib(num_blocks: int) -> float:  # half a block more, so flooring gives num_blocks
        return (num_blocks + 0.5) * block_bytes / GIB

    return SimSetup(
        profile,
        gib(args.num_hbm_blocks),
        gib(args.num_dram_blocks),
        "auto" if args.b_xfer is None else args.b_xfer,  # the simulator's B_xfer is its setup's
        args.max_num_batched_tokens,
        args.max_num_seqs,
    )


def run_simulated(args: argparse.Namespace, profile_path: Path) -> dict[str, dict[str, Any]]:
    setup = sim_setup(args, load_profile(profile_path))
    knobs = Knobs(slo_ttft_s=args.ttft_slo, slo_tbt_s=args.tbt_slo)
    jobs = [
        SweepJob(
            args.trace, args.rps, args.duration, policy, knobs, setup, args.burstiness, args.seed
        )
        for policy in POLICIES
    ]
    return {job.policy: row for job, (row, _) in zip(jobs, run_sweep(jobs), strict=True)}


def summary(row: dict[str, Any]) -> str:
    parts = []
    for key, label, scale in SHOWN:
        value = row.get(key)
        parts.append(f"{label} {'-' if value is None else f'{scale * value:.3g}'}")
    return ", ".join(parts)


def print_table(sources: dict[str, dict[str, dict[str, Any]]]) -> None:
    print(f"{'':30}" + "".join(f"{label:>11}" for _, label, _ in SHOWN))
    for source, rows in sources.items():
        for policy in POLICIES:
            print(f"{source + ' ' + policy:30}" + "".join(_cell(rows[policy], s) for s in SHOWN))
        diff = {key: _delta(rows, key) for key, _, _ in SHOWN}
        print(f"{source + ' lvf-vllm':30}" + "".join(_cell(diff, s) for s in SHOWN))


def _delta(rows: dict, key: str) -> float | None:
    a, b = rows["lvf"].get(key), rows["vllm"].get(key)
    return None if a is None or b is None else a - b


def _cell(row: dict, shown: tuple[str, str, float]) -> str:
    key, _, scale = shown
    value = row.get(key)
    return f"{'-' if value is None else f'{scale * value:.3g}':>11}"


def delta_pts(rows: dict[str, dict[str, Any]]) -> float:
    return 100 * (rows["lvf"]["ttft_attainment"] - rows["vllm"]["ttft_attainment"])


def main() -> int:
    args = parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="e2e-compare-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"host load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    engine_profile = Path(args.profile) if args.profile else fit_profile(args, out)
    served, calibrated = run_served(args, out, engine_profile)
    sources = {"served": served}
    for tag, (path, _) in calibrated.items():
        sources[f"sim (served, {tag})"] = run_simulated(args, path)
    sources["sim (engine profile)"] = run_simulated(args, engine_profile)
    (out / "e2e_compare.json").write_text(
        json.dumps({"args": vars(args), **sources}, indent=2) + "\n", encoding="utf-8"
    )
    print_table(sources)
    served_pts = delta_pts(served)
    sim_pts = {tag: delta_pts(sources[f"sim (served, {tag})"]) for tag in calibrated}
    low, high = min(sim_pts.values()), max(sim_pts.values())
    gap_pts = 0.0 if low <= served_pts <= high else min(abs(served_pts - v) for v in (low, high))
    agree = gap_pts <= args.tolerance_pts
    print(f"outputs in {out}; host load average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    sim = sources["sim (served, before)"]
    print(
        "RESULT e2e_compare"
        f" served_ttft_vllm={served['vllm']['ttft_attainment']:.3f}"
        f" served_ttft_lvf={served['lvf']['ttft_attainment']:.3f}"
        f" served_delta_pts={served_pts:.1f}"
        f" sim_ttft_vllm={sim['vllm']['ttft_attainment']:.3f}"
        f" sim_ttft_lvf={sim['lvf']['ttft_attainment']:.3f}"
        f" sim_delta_pts={sim_pts['before']:.1f} sim_delta_pts_after={sim_pts['after']:.1f}"
        f" engine_profile_delta_pts={delta_pts(sources['sim (engine profile)']):.1f}"
        f" overhead_ms={1000 * calibrated['before'][1]:.2f}"
        f" overhead_ms_after={1000 * calibrated['after'][1]:.2f}"
        f" gap_pts={gap_pts:.1f} tolerance_pts={args.tolerance_pts:g} agree={int(agree)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
