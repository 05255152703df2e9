"""Snapshot -> plan round trip over loopback Redis, through a real `superinfer control-plane`
process, for 256 and 4,096 requests. A stand-in worker publishes one snapshot per iteration
(every --iteration-ms) and reads the plan back; an iteration whose plan had not arrived when the
next iteration started counts as stalled (the worker would have planned locally instead of
waiting). The round trip is timed from the moment the worker has its policy columns: packing
and encoding the snapshot, XADD, the control plane's read, decode, plan and XADD, and the
worker's read and decode of the plan. Measuring starts once the control plane is up, after a
few warm-up iterations. Ends with a RESULT line.

    .venv/bin/python bench/plan_latency.py [--redis-url URL] [--iterations 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from redis.asyncio import Redis

from shared import streams
from shared.bus import queue_snapshot
from shared.knobs import write_knobs
from shared.policy.columns import ROTARY_CODE, RUNNING_CODE, WAITING_CODE, RequestColumns
from shared.protocol import RotationPlan, StateSnapshot, decode, encode
from shared.protocol.convert import table_from_columns
from shared.runtime import collect_due_garbage, garbage_collected_between_iterations

# What a run leaves in Redis: its streams, and the lease and plan fence of its worker (an
# earlier run's fence would refuse plans for iterations it already planned).
BENCH_KEYS = (
    streams.worker_snapshots_stream("bench-w"),
    streams.SNAPSHOT_WORKERS_KEY,
    streams.worker_plans_stream("bench-w"),
    streams.worker_owner_key("bench-w"),
    streams.worker_plan_fence_key("bench-w"),
)
WARMUP_ITERATIONS = 5  # the first plans after start-up (imports, connections) are not counted
SNAPSHOT_SCALARS = dict(
    num_free_hbm_blocks=200,
    num_free_dram_blocks=100_000,
    num_hbm_blocks=50_000,
    num_dram_blocks=200_000,
    block_size=16,
    block_bytes=2 << 20,
    max_num_batched_tokens=8192,
    max_num_seqs=4096,
    b_xfer_blocks=1200,
    iteration_time_s=0.05,
    link_bytes_per_s=5e10,
    plan_source="remote",
)


def make_columns(num: int, rng: np.random.Generator) -> RequestColumns:
    """Half running, a quarter waiting, a quarter rotary (by index mod 4), as the worker's
    engine would report them: the policy columns the worker packs for the wire."""
    now = time.time()
    kind = np.arange(num) % 4
    states = np.where(kind < 2, RUNNING_CODE, np.where(kind == 2, WAITING_CODE, ROTARY_CODE))
    running, rotary = states == RUNNING_CODE, states == ROTARY_CODE
    computed = np.where(states != WAITING_CODE, rng.integers(16, 2001, num), 0)
    blocks = -(-computed // 16)
    nan = np.full(num, np.nan)
    return RequestColumns(
        request_ids=[f"cmpl-{index:032x}" for index in range(num)],  # the gateway's format
        states=states.astype(np.uint8),
        t_arr_s=now - rng.uniform(0, 30, num),
        t_run_s=np.where(running, now - rng.uniform(0, 10, num), np.nan),
        t_last_s=np.where(rotary, now - rng.uniform(0, 1, num), np.nan),
        slo_ttft_s=nan,
        slo_tbt_s=nan,
        num_tokens=computed + rng.integers(1, 501, num),
        num_computed_tokens=computed,
        num_blocks_hbm=np.where(running, blocks, 0),
        num_blocks_dram=np.where(rotary, blocks, 0),
        priority=np.zeros(num, np.int64),
        arrival_seq=np.arange(num, dtype=np.int64),
        resident=np.ones(num, np.bool_),
        tenants=np.zeros(num, np.int64),
        t_first_s=np.where(running | rotary, now - rng.uniform(1, 5, num), np.nan),
        num_output_tokens=np.where(running | rotary, rng.integers(1, 100, num), 0),
    )


def snapshot_message(columns: RequestColumns, iteration: int) -> StateSnapshot:
    """What the worker publishes: the columns packed into a table, plus the scalars."""
    return StateSnapshot(
        "bench-w",
        "epoch-1",
        iteration,
        time.time(),
        table_from_columns(columns),
        **SNAPSHOT_SCALARS,  # type: ignore[arg-type]
    )


async def measure(
    redis: Redis, num: int, iterations: int, period_s: float, first: int = 0
) -> tuple[list[float], int]:
    """Iterations ``first .. first + iterations - 1`` (iteration numbers only grow, as a
    worker's do: the control plane's fence publishes one plan per iteration)."""
    rng = np.random.default_rng(0)
    plans = streams.worker_plans_stream("bench-w")
    last = (await redis.xrevrange(plans, count=1) or [(b"0-0", {})])[0][0]
    latencies: list[float] = []
    stalled = 0
    for iteration in range(first, first + iterations):
        columns = make_columns(num, rng)
        t_sent = time.perf_counter()  # from here: pack + encode, the round trip, decode
        msg = snapshot_message(columns, iteration)
        async with redis.pipeline(transaction=False) as pipe:
            queue_snapshot(pipe, "bench-w", encode(msg), time.time())  # as the worker does
            await pipe.execute()
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
        collect_due_garbage()  # as the worker does between iterations
        await asyncio.sleep(max(0.0, period_s - latency))
    return latencies, stalled


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1e3


async def wait_until_ready(redis: Redis, timeout_s: float = 60.0) -> None:
    """Until the control plane's heartbeat appears (it sets it before its first read)."""
    deadline = time.monotonic() + timeout_s
    while not await redis.exists(streams.CONTROL_PLANE_HEARTBEAT_KEY):
        if time.monotonic() > deadline:
            raise SystemExit("the control plane did not start")
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # its first XREAD is on its way


async def main_async(args: argparse.Namespace) -> None:
    redis = Redis.from_url(args.redis_url)
    await redis.delete(*BENCH_KEYS, streams.CONTROL_PLANE_HEARTBEAT_KEY)
    await write_knobs(redis, {"policy": "lvf"})
    env = {**os.environ, "SUPERINFER_REDIS_URL": args.redis_url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "superinfer", "control-plane"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await wait_until_ready(redis)
        await measure(redis, 256, WARMUP_ITERATIONS, args.iteration_ms / 1e3)  # not counted
        results = {}
        for index, num in enumerate((256, 4096)):
            first = WARMUP_ITERATIONS + index * args.iterations
            period_s = args.iteration_ms / 1e3
            lat, stalled = await measure(redis, num, args.iterations, period_s, first)
            results[num] = (pct(lat, 50), pct(lat, 99), stalled)
            print(
                f"{num:5d} requests: p50 {results[num][0]:.2f} ms  p99 {results[num][1]:.2f} ms"
                f"  stalled {stalled}/{args.iterations} (iteration {args.iteration_ms} ms)"
            )
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        await redis.delete(*BENCH_KEYS)
        await redis.aclose()
    p50, p99, stalled = results[4096]
    print(
        f"RESULT plan_latency p50_ms_4096={p50:.2f} p99_ms_4096={p99:.2f} "
        f"p50_ms_256={results[256][0]:.2f} p99_ms_256={results[256][1]:.2f} "
        f"stalled_iterations={stalled + results[256][2]}"
    )


async def main_collecting(args: argparse.Namespace) -> None:
    with garbage_collected_between_iterations():  # the worker's discipline
        await main_async(args)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/8",
        help="a database of its own (the tests use db 9); the bench clears its streams",
    )
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument(
        "--iteration-ms",
        type=float,
        default=50.0,
        help="worker iteration time (the paper's 8B iterations: ~70 ms)",
    )
    asyncio.run(main_collecting(parser.parse_args()))


if __name__ == "__main__":
    main()
