"""Snapshot -> plan round trip over loopback Redis, through a real `superinfer control-plane`
process, for 256 and 4,096 requests. A stand-in worker publishes one snapshot per iteration
(every --iteration-ms) and reads the plan back; an iteration whose plan had not arrived when the
next iteration started counts as stalled (the worker would have planned locally instead of
waiting). Ends with a RESULT line.

    .venv/bin/python bench/plan_latency.py [--redis-url URL] [--iterations 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time

from redis.asyncio import Redis

from shared import streams
from shared.knobs import write_knobs
from shared.protocol import RequestRow, RotationPlan, StateSnapshot, decode, encode

STATES = ("running", "waiting", "rotary")


def make_snapshot(num: int, iteration: int, rng: random.Random) -> StateSnapshot:
    now = time.time()
    rows = []
    for index in range(num):
        state = STATES[0] if index % 4 < 2 else STATES[index % 4 - 1]
        computed = rng.randint(16, 2000) if state != "waiting" else 0
        rows.append(
            RequestRow(
                f"req-{index}",
                state,
                now - rng.uniform(0, 30),
                now - rng.uniform(0, 10) if state == "running" else None,
                now - rng.uniform(0, 1) if state == "rotary" else None,
                computed + rng.randint(1, 500),
                computed,
                -(-computed // 16) if state == "running" else 0,
                -(-computed // 16) if state == "rotary" else 0,
                0,
                0,
                None,
                None,
                True,
                index,
            )
        )
    return StateSnapshot(
        "bench-w",
        "epoch-1",
        iteration,
        now,
        rows,
        200,
        100_000,
        50_000,
        200_000,
        16,
        2 << 20,
        8192,
        4096,
        1200,
        0.05,
        5e10,
        "remote",
    )


async def measure(
    redis: Redis, num: int, iterations: int, period_s: float
) -> tuple[list[float], int]:
    rng = random.Random(0)
    plans = streams.worker_plans_stream("bench-w")
    last = (await redis.xrevrange(plans, count=1) or [(b"0-0", {})])[0][0]
    latencies: list[float] = []
    stalled = 0
    for iteration in range(iterations):
        msg = make_snapshot(num, iteration, rng)
        t_sent = time.perf_counter()
        await redis.xadd(
            streams.SNAPSHOTS_STREAM, {"m": encode(msg)}, maxlen=1000, approximate=True
        )
        got = None
        while got is None:
            remaining_ms = max(1, int((t_sent + 1.0 - time.perf_counter()) * 1e3))
            resp = await redis.xread({plans: last}, count=16, block=remaining_ms)
            if not resp:
                break
            for _, entries in resp:
                for entry_id, fields in entries:
                    last = entry_id
                    plan = decode(fields[b"m"], RotationPlan)
                    if plan.snapshot_iteration == iteration:
                        got = plan
        latency = time.perf_counter() - t_sent
        latencies.append(latency)
        if got is None or latency > period_s:
            stalled += 1
        await asyncio.sleep(max(0.0, period_s - latency))
    return latencies, stalled


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1e3


async def main_async(args: argparse.Namespace) -> None:
    redis = Redis.from_url(args.redis_url)
    await redis.delete(streams.SNAPSHOTS_STREAM, streams.worker_plans_stream("bench-w"))
    await write_knobs(redis, {"policy": "lvf"})
    env = {**os.environ, "SUPERINFER_REDIS_URL": args.redis_url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "superinfer", "control-plane"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await asyncio.sleep(2.0)
        results = {}
        for num in (256, 4096):
            lat, stalled = await measure(redis, num, args.iterations, args.iteration_ms / 1e3)
            results[num] = (pct(lat, 50), pct(lat, 99), stalled)
            print(
                f"{num:5d} requests: p50 {results[num][0]:.2f} ms  p99 {results[num][1]:.2f} ms"
                f"  stalled {stalled}/{args.iterations} (iteration {args.iteration_ms} ms)"
            )
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        await redis.delete(streams.SNAPSHOTS_STREAM, streams.worker_plans_stream("bench-w"))
        await redis.aclose()
    p50, p99, stalled = results[4096]
    print(
        f"RESULT plan_latency p50_ms_4096={p50:.2f} p99_ms_4096={p99:.2f} "
        f"p50_ms_256={results[256][0]:.2f} p99_ms_256={results[256][1]:.2f} "
        f"stalled_iterations={stalled + results[256][2]}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument(
        "--iteration-ms",
        type=float,
        default=50.0,
        help="worker iteration time (the paper's 8B iterations: ~70 ms)",
    )
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
