"""How long one LVF plan takes (SUPERINFER.md §4, §5: the plan for iteration i+1 is computed
while iteration i runs, so it must stay far below one iteration).

Snapshots of 256, 1,024 and 4,096 requests mix running (mostly decodes, a few prefill chunks,
some just resumed), waiting (in queue order, a few preempted ones at the front) and rotary
requests (in rotation order) under memory contention, so every call takes LVF's full path
(ranking, head scan, tail scan, packing) rather than the FCFS fallback. Each size is planned
>= 200 times after a warm-up; p50/p99 of ``time.perf_counter`` per call are printed for

- ``columns``: the columnar LVF on a ``ColumnarSnapshot`` (the control plane's path: its
  snapshots arrive as packed columns), the full plan including the batch's chunks. The RESULT
  line's ``p50_ms_*``/``p99_ms_*`` are this path;
- ``views``: the view-walking LVF on the engine's ``Snapshot`` of ``RequestView`` objects (the
  worker's local fallback), ``views_*`` in the RESULT line;
- ``convert``: building the columns from the views once (``columnar_from_snapshot``), which a
  caller holding only views would pay on top of ``columns``.

Both paths make the same plan (checked here, and by tests/shared/test_policy_columnar.py).

    .venv/bin/python bench/policy_speed.py [--calls 500] [--profile]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from shared.policy import (
    ColumnarSnapshot,
    Knobs,
    RequestState,
    RequestView,
    Snapshot,
    columnar_from_snapshot,
    make_plan,
)

BLOCK_SIZE = 16
T_NOW_S = 10_000.0
SIZES = (256, 1024, 4096)


def _blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def _prompt_len(rng: random.Random) -> int:
    return max(4, min(4096, int(rng.lognormvariate(5.5, 1.0))))  # ShareGPT-like, median ~245


def _running(rng: random.Random, index: int) -> RequestView:
    prompt = _prompt_len(rng)
    generated = rng.randint(0, 400)
    t_run = T_NOW_S - rng.uniform(0.0, 60.0)
    num_tokens = prompt + generated + (1 if generated else 0)
    computed = num_tokens - 1 if rng.random() < 0.99 else rng.randint(0, prompt - 1)
    return RequestView(
        f"run-{index}",
        RequestState.RUNNING,
        t_arr_s=t_run - rng.uniform(0.0, 5.0),
        num_tokens=num_tokens,
        num_computed_tokens=computed,
        num_blocks_hbm=_blocks(computed),
        num_blocks_dram=_blocks(computed) // 2,
        t_run_s=t_run,
        t_last_s=T_NOW_S - 0.05,
        arrival_seq=index,
        resident=rng.random() > 0.02,
    )


def _waiting(rng: random.Random, index: int, t_arr: float) -> RequestView:
    slo = 2.0 if rng.random() < 0.1 else None  # an interactive SLO class for some requests
    return RequestView(
        f"wait-{index}",
        RequestState.WAITING,
        t_arr_s=t_arr,
        num_tokens=_prompt_len(rng),
        arrival_seq=index,
        slo_ttft_s=slo,
    )


def _rotary(rng: random.Random, index: int, t_last: float) -> RequestView:
    num_tokens = _prompt_len(rng) + rng.randint(1, 300)
    return RequestView(
        f"rot-{index}",
        RequestState.ROTARY,
        t_arr_s=t_last - rng.uniform(1.0, 30.0),
        num_tokens=num_tokens,
        num_computed_tokens=num_tokens - 1,
        num_blocks_dram=_blocks(num_tokens - 1),
        t_run_s=t_last - 1.0,
        t_last_s=t_last,
        arrival_seq=index,
    )


def make_snapshot(num_requests: int, seed: int = 0) -> Snapshot:
    """1/8 running, 5/8 waiting (arrival order, the oldest lagging past beta_F * S_F), 1/4
    rotary (rotation order); a little free HBM, plenty of DRAM."""
    rng = random.Random(seed)
    num_running, num_waiting = num_requests // 8, num_requests * 5 // 8
    views = [_running(rng, i) for i in range(num_running)]
    arrivals = sorted(T_NOW_S - rng.uniform(0.0, 8.0) for _ in range(num_waiting))
    views += [_waiting(rng, num_running + i, t) for i, t in enumerate(arrivals)]
    lasts = sorted(T_NOW_S - rng.uniform(0.0, 1.0) for _ in range(num_requests - len(views)))
    views += [_rotary(rng, len(views) + i, t) for i, t in enumerate(lasts)]
    return Snapshot(
        t_now_s=T_NOW_S,
        requests=tuple(views),
        num_free_hbm_blocks=64,
        num_free_dram_blocks=1_000_000,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=8192,
        max_num_seqs=num_requests // 4,
        b_xfer_blocks=2400,
    )


def time_calls(snapshot: Snapshot | ColumnarSnapshot, knobs: Knobs, calls: int) -> list[float]:
    """Per-call wall time in ms, after a warm-up of 20 calls."""
    for _ in range(20):
        make_plan(snapshot, knobs)
    times: list[float] = []
    for _ in range(calls):
        start = time.perf_counter()
        make_plan(snapshot, knobs)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def convert_ms(snapshot: Snapshot, calls: int) -> float:
    """Median time to build the columns from the views, in ms."""
    times = []
    for _ in range(max(5, calls // 20)):
        start = time.perf_counter()
        columnar_from_snapshot(snapshot)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(size: int, knobs: Knobs, calls: int) -> dict[str, float]:
    snapshot = make_snapshot(size)
    columnar = columnar_from_snapshot(snapshot)
    plan = make_plan(columnar, knobs)
    if plan.fcfs_fallback or not plan.rotate_out_ids:
        raise SystemExit(f"{size}: the snapshot does not exercise LVF's full path")
    if make_plan(snapshot, knobs) != plan:
        raise SystemExit(f"{size}: the columnar and view plans differ")
    columns_ms = time_calls(columnar, knobs, calls)
    views_ms = time_calls(snapshot, knobs, calls)
    stats = {
        "p50": statistics.median(columns_ms),
        "p99": percentile(columns_ms, 0.99),
        "views_p50": statistics.median(views_ms),
        "views_p99": percentile(views_ms, 0.99),
        "convert": convert_ms(snapshot, calls),
    }
    print(
        f"lvf n={size:>5}: columns p50 {stats['p50']:.3f} ms  p99 {stats['p99']:.3f} ms | "
        f"views p50 {stats['views_p50']:.3f} ms  p99 {stats['views_p99']:.3f} ms | "
        f"convert {stats['convert']:.3f} ms  (admit {len(plan.admit_ids)}, resume "
        f"{len(plan.resume_ids)}, rotate out {len(plan.rotate_out_ids)}, scheduled "
        f"{len(plan.schedule)})"
    )
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="timed calls per size (>= 200)")
    parser.add_argument("--profile", action="store_true", help="cProfile the 4,096 case")
    args = parser.parse_args()
    if args.calls < 200:
        raise SystemExit("--calls must be >= 200")
    knobs = Knobs(policy="lvf")
    stats = {size: measure(size, knobs, args.calls) for size in SIZES}
    if args.profile:
        import cProfile
        import pstats

        snapshot = columnar_from_snapshot(make_snapshot(SIZES[-1]))
        profiler = cProfile.Profile()
        profiler.runcall(time_calls, snapshot, knobs, args.calls)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    big, mid, small = stats[4096], stats[1024], stats[256]
    print(
        f"RESULT policy_speed p50_ms_4096={big['p50']:.3f} p99_ms_4096={big['p99']:.3f}"
        f" p50_ms_1024={mid['p50']:.3f} p99_ms_256={small['p99']:.3f}"
        f" views_p50_ms_4096={big['views_p50']:.3f} views_p99_ms_4096={big['views_p99']:.3f}"
        f" convert_ms_4096={big['convert']:.3f}"
    )


if __name__ == "__main__":
    main()
