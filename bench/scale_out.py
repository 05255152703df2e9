"""Scale-out: stand-in workers (lab/standin.py: no model, real snapshots and plans) against one
and two `superinfer control-plane` replicas (separate processes, sharing the workers through
leases), over one Redis. For 1, 8, 32 and 64 workers at --rate iterations/s with --requests
requests each: plans/s served, plan age p50/p99 in iterations (at each iteration, the age of the
newest plan the worker had), stalled iterations (no plan at most 4 iterations old: the worker
would have planned locally), the replicas' CPU seconds per plan, Redis used memory (peak during
the window) and network bytes/s, and the snapshot's mean size on the wire. Snapshots travel
as deltas (the rows changed since the newest plan's table); at the largest worker count each
replica count is run again with whole tables, the baseline of ``delta_bytes_ratio``. The
stand-ins run in this process (its lateness is printed: a late generator understates the
load). ``--max-num-seqs 256 --requests 4096`` models an overloaded engine (256 running, the
rest waiting or rotary). Ends with a RESULT line.

    .venv/bin/python bench/scale_out.py [--redis-url URL] [--seconds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from redis.asyncio import Redis

from lab.standin import Fleet, make_fleet
from shared import streams
from shared.knobs import write_knobs

WORKER_COUNTS = (1, 8, 32, 64)
FRESH_STALLED_FRAC = 0.01  # "fresh plans": at most 1% of iterations planned locally
KEPT_RATE = 0.95  # ... and only where the stand-ins kept 95% of the rate (else: not loaded)


@dataclass
class Row:
    replicas: int
    workers: int
    plans_per_s: float
    age_p50: float
    age_p99: float
    stalled_frac: float
    duplicates: int
    cpu_ms_per_plan: float
    used_memory_mb: float
    net_in_mb_s: float
    net_out_mb_s: float
    iterations_per_s: float  # achieved by the stand-ins, all together
    redis_cpu_us_per_snapshot: float
    deltas: bool  # snapshots sent as deltas when that pays
    snapshot_kb: float  # mean encoded snapshot
    delta_frac: float  # of the snapshots, those sent as a delta


def start_replica(url: str, index: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SUPERINFER_REDIS_URL": url, "SUPERINFER_WORKER_RELEASE_S": "2"}
    return subprocess.Popen(
        [sys.executable, "-m", "superinfer", "control-plane", f"--replica-id=cp{index}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_for(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def all_owned(redis: Redis, fleet: Fleet, replicas: int) -> bool:
    keys = [streams.worker_owner_key(s.worker_id) for s in fleet.standins]
    owners = await redis.mget(keys)
    share = -(-len(keys) // replicas)
    counts = [owners.count(f"cp{i}".encode()) for i in range(replicas)]
    return None not in owners and max(counts) <= share


async def net_bytes(redis: Redis) -> tuple[int, int, float, float]:
    """Redis's network bytes in and out, its CPU seconds (server-wide), the time."""
    info = await redis.info("stats")
    cpu = await redis.info("cpu")
    used_cpu = float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    net = (int(info["total_net_input_bytes"]), int(info["total_net_output_bytes"]))
    return net[0], net[1], used_cpu, time.time()


async def forget(redis: Redis, fleet: Fleet) -> None:
    """What stopped stand-ins leave: their registry entries and streams (a worker's clean stop
    removes its entry; its snapshot stream would expire)."""
    ids = [s.worker_id for s in fleet.standins]
    await redis.zrem(streams.SNAPSHOT_WORKERS_KEY, *ids)
    await redis.delete(*[streams.worker_snapshots_stream(w) for w in ids])
    await redis.delete(*[streams.worker_plans_stream(w) for w in ids])


async def measure(
    redis: Redis,
    procs: list[subprocess.Popen[bytes]],
    workers: int,
    args: argparse.Namespace,
    deltas: bool = True,
) -> Row:
    replicas = len(procs)
    prefix = f"r{replicas}w{workers}{'d' if deltas else 'f'}"
    fleet = make_fleet(redis, workers, args.requests, args.rate, prefix, deltas, args.max_num_seqs)
    stop = asyncio.Event()
    task = asyncio.create_task(fleet.run(stop))
    try:
        await wait_for(lambda: all_owned(redis, fleet, replicas), 20, "leases")
        await asyncio.sleep(1.0)  # the first plans, the rebalancing settled
        fleet.reset_stats()
        cpu0 = sum(cpu_s(p.pid) for p in procs)
        net0 = await net_bytes(redis)
        peak = 0
        for _ in range(int(args.seconds / 0.5)):
            await asyncio.sleep(0.5)
            peak = max(peak, int((await redis.info("memory"))["used_memory"]))
        net1 = await net_bytes(redis)
        cpu1 = sum(cpu_s(p.pid) for p in procs)
        totals = fleet.totals()
    finally:
        stop.set()
        await task
        await forget(redis, fleet)
    seconds = net1[3] - net0[3]
    ages = np.array(totals.ages or [0])
    return Row(
        replicas=replicas,
        workers=workers,
        plans_per_s=totals.plans / seconds,
        age_p50=float(np.percentile(ages, 50)),
        age_p99=float(np.percentile(ages, 99)),
        stalled_frac=totals.stalled / max(1, totals.iterations),
        duplicates=totals.duplicates,
        cpu_ms_per_plan=(cpu1 - cpu0) * 1e3 / max(1, totals.plans),
        used_memory_mb=peak / 1e6,
        net_in_mb_s=(net1[0] - net0[0]) / seconds / 1e6,
        net_out_mb_s=(net1[1] - net0[1]) / seconds / 1e6,
        iterations_per_s=totals.iterations / seconds,
        redis_cpu_us_per_snapshot=(net1[2] - net0[2]) * 1e6 / max(1, totals.iterations),
        deltas=deltas,
        snapshot_kb=totals.snapshot_bytes / max(1, totals.iterations) / 1e3,
        delta_frac=totals.deltas / max(1, totals.iterations),
    )


def show(row: Row, args: argparse.Namespace) -> None:
    print(
        f"replicas {row.replicas} workers {row.workers:3d} {'delta' if row.deltas else 'whole'}: "
        f"snapshot {row.snapshot_kb:5.1f} KB ({row.delta_frac:4.0%} deltas)  "
        f"plans/s {row.plans_per_s:7.1f}  "
        f"age p50 {row.age_p50:.0f} p99 {row.age_p99:.0f}  stalled {row.stalled_frac:.3f}  "
        f"dup {row.duplicates}  cpu/plan {row.cpu_ms_per_plan:.2f} ms  "
        f"redis {row.used_memory_mb:.1f} MB in {row.net_in_mb_s:.1f} MB/s "
        f"out {row.net_out_mb_s:.1f} MB/s cpu/snapshot {row.redis_cpu_us_per_snapshot:.0f} us  "
        f"stand-ins {row.iterations_per_s:.0f} it/s of {row.workers * args.rate:.0f}",
        flush=True,
    )


async def run(args: argparse.Namespace) -> list[Row]:
    redis = Redis.from_url(args.redis_url)
    await redis.flushdb()  # a database of its own
    await write_knobs(redis, {"policy": "lvf"})
    procs: list[subprocess.Popen[bytes]] = []
    rows = []
    try:
        for replicas in args.replicas:
            while len(procs) < replicas:
                procs.append(start_replica(args.redis_url, len(procs)))
            await wait_for(
                lambda: redis.exists(streams.CONTROL_PLANE_HEARTBEAT_KEY), 60, "control plane"
            )
            runs = [(workers, True) for workers in args.workers]
            runs += [(max(args.workers), False)] if args.baseline else []
            for workers, deltas in runs:
                rows.append(await measure(redis, procs, workers, args, deltas))
                show(rows[-1], args)
                await asyncio.sleep(2.5)  # the replicas forget these workers
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        await redis.flushdb()
        await redis.aclose()
    return rows


def result_line(rows: list[Row], rate: float) -> str:
    delta_rows = [r for r in rows if r.deltas]
    fresh = [
        r.workers
        for r in delta_rows
        if r.stalled_frac <= FRESH_STALLED_FRAC
        and r.iterations_per_s >= KEPT_RATE * r.workers * rate
    ]
    one = [r for r in delta_rows if r.replicas == 1]
    top = max((r.workers for r in rows), default=0)
    at_top = [r for r in delta_rows if r.workers == top]
    per_replica = max((r.plans_per_s for r in one), default=0.0)
    cpu_per_plan = min((r.cpu_ms_per_plan for r in one if r.workers > 1), default=0.0)
    ratios = [  # per snapshot, and Redis egress per iteration (the rates may differ)
        (
            d.snapshot_kb / w.snapshot_kb,
            (d.net_out_mb_s / d.iterations_per_s) / max(1e-9, w.net_out_mb_s / w.iterations_per_s),
        )
        for d in at_top
        for w in rows
        if not w.deltas and w.workers == top and w.replicas == d.replicas
    ]
    return (
        f"RESULT scale_out max_workers_fresh_plans={max(fresh, default=0)} "
        f"plans_per_s_per_replica={per_replica:.0f} "
        f"stalled_frac_{top}={min((r.stalled_frac for r in at_top), default=1.0):.3f} "
        f"replica_cpu_ms_per_plan={cpu_per_plan:.2f} "
        f"duplicates={sum(r.duplicates for r in rows)} "
        f"standin_it_s_{top}={max((r.iterations_per_s for r in at_top), default=0):.0f} "
        f"snapshot_kb_{top}={min((r.snapshot_kb for r in at_top), default=0):.1f} "
        f"delta_bytes_ratio={min((r[0] for r in ratios), default=1.0):.3f} "
        f"redis_out_ratio_delta={min((r[1] for r in ratios), default=1.0):.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/10")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured window per run")
    parser.add_argument("--rate", type=float, default=20.0, help="iterations/s per worker")
    parser.add_argument("--requests", type=int, default=1024, help="requests per worker")
    parser.add_argument("--workers", type=int, nargs="+", default=list(WORKER_COUNTS))
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="running requests per worker (default: half)"
    )
    parser.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the whole-table run at the largest worker count",
    )
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; stand-ins in this process, replicas in their own", flush=True)
    rows = asyncio.run(run(args))
    print(result_line(rows, args.rate))


if __name__ == "__main__":
    main()
