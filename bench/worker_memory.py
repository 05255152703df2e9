"""A worker's retained memory over many iterations: flat, or something grows per iteration.

Runs a serving worker's in-process loop without Redis: the real engine (stories260K when the
kit beside the checkout has it, else ``tiny-random``; ``--model`` for another) in serving mode
(columnar snapshots, the worker's :class:`~data_plane.planner.HybridPlanner` planning locally)
over HBM + a DRAM tier with prefix caching, a planner wrapper that rotates random running
requests out (so eager syncs, evictions, loads and the DRAM prefix level all run), and per
iteration what the worker does with a step: its token outputs through
:class:`~data_plane.replies.Replies` and its snapshot encoded for the control plane. A steady
stream of short requests (shared prefixes, 1-6 output tokens) is added, aborted at random and
finished.

After ``--warmup`` iterations (every bounded cache and ring fills up), it samples every
``--iterations / --samples`` iterations, each time with the engine drained (no live request, no
copy in flight) and after ``gc.collect()``: tracemalloc's traced bytes, ``len(gc.get_objects())``
and RSS (torch's allocator is invisible to tracemalloc; RSS is noisy, printed only). Prints one
row per sample and the growth per 10k iterations; the last line is
``RESULT worker_memory iterations=... traced_growth_kib=... objects_growth=... load_avg=...``
(growth: last sample minus the first one after warm-up).

    .venv/bin/python bench/worker_memory.py [--iterations 20000] [--executor model|null]
        [--model PATH] [--policy lvf] [--warmup 3000] [--samples 10]

About 9 ms of CPU an iteration with stories260K under tracemalloc (3 ms with ``--executor
null``) on the 2-core dev host: the default 20,000 takes 3-6 minutes there; the issue's
100,000 (``--iterations 100000``) about half an hour.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_plane.engine.batch import BatchItem, Executor, Sampled  # noqa: E402
from data_plane.engine.config import EngineConfig  # noqa: E402
from data_plane.engine.engine import Engine  # noqa: E402
from data_plane.engine.llm import Serving, build_engine  # noqa: E402
from data_plane.engine.sampling import SamplingParams  # noqa: E402
from data_plane.models import load_model  # noqa: E402
from data_plane.planner import HybridPlanner  # noqa: E402
from data_plane.replies import Replies  # noqa: E402
from data_plane.reports import WorkerIdentity, state_snapshot  # noqa: E402
from shared.policy import ColumnarSnapshot, Knobs, Plan, Snapshot  # noqa: E402
from shared.policy.columns import RUNNING_CODE, pick_ids  # noqa: E402
from shared.protocol import encode  # noqa: E402
from shared.protocol.delta import DeltaEncoder  # noqa: E402

KIT = Path(os.environ.get("SUPERINFER_KIT", ROOT.parent / "shared"))
STORIES = KIT / "models" / "stories260K" / "stories260K.bin"
CONFIG = EngineConfig(
    block_size=4,
    num_hbm_blocks=48,
    num_dram_blocks=256,
    max_num_batched_tokens=32,
    max_num_seqs=16,
    prefix_caching=True,
)
PREFIXES = [[1, 300 + p, 301 + p, 302 + p, 303 + p, 304 + p, 305 + p, 306 + p] for p in range(4)]
MAX_DRAIN_ITERATIONS = 10_000  # a drain that takes longer is a stall, not a measurement
KIB = 1024


class RandomRotations:
    """The worker's planner, plus random rotate-outs of resident running requests (the tiered
    paths run whatever the policy decides)."""

    def __init__(self, inner: HybridPlanner, rng: random.Random, p_out: float) -> None:
        self.inner, self.rng, self.p_out = inner, rng, p_out

    def __call__(self, snapshot: Snapshot | ColumnarSnapshot) -> Plan:
        plan = self.inner(snapshot)
        if not isinstance(snapshot, ColumnarSnapshot):
            raise TypeError("the serving engine plans on columns")
        columns = snapshot.requests
        running = np.flatnonzero((columns.states == RUNNING_CODE) & columns.resident)
        leaving = set(plan.preempt_ids) | set(plan.rotate_out_ids)
        chosen = [
            rid
            for rid in pick_ids(columns.request_ids, running)
            if rid not in leaving and self.rng.random() < self.p_out
        ]
        if chosen:
            out = set(chosen)
            plan.rotate_out_ids = [*plan.rotate_out_ids, *chosen]
            plan.schedule = [c for c in plan.schedule if c.request_id not in out]
        return plan


class NullExecutor(Executor):
    """No model: token 3 for every request whose chunk reaches its last token (``--executor
    null``: the engine, KV tiers and copies as they are, at about a third of the cost)."""

    def execute(self, items: list[BatchItem]) -> Sampled:
        return Sampled(
            {
                item.request.request_id: 3
                for item in items
                if item.request.num_computed_tokens + item.num_tokens >= item.request.num_tokens
            }
        )


@dataclass(slots=True)
class Loop:
    """The worker's per-iteration work around one engine: requests in, step, outputs out,
    snapshot encoded."""

    engine: Engine
    planner: HybridPlanner
    rng: random.Random
    replies: Replies = field(default_factory=Replies)
    deltas: DeltaEncoder = field(default_factory=DeltaEncoder)
    live: set[str] = field(default_factory=set)
    num_added: int = 0
    num_iterations: int = 0
    warmup_iterations: int = 0  # before the first sample (measure's warm-up)

    def add(self) -> None:
        rng = self.rng
        prompt = [*rng.choice(PREFIXES), *(rng.randrange(3, 500) for _ in range(rng.randrange(7)))]
        sampled = rng.random() < 0.5
        params = SamplingParams(
            max_tokens=rng.randint(1, 6),
            temperature=0.8 if sampled else 0.0,
            seed=self.num_added if sampled else None,
            ignore_eos=True,
        )
        request_id = f"r{self.num_added}"
        self.num_added += 1
        self.engine.add_request(request_id, prompt, params, slo_ttft_s=1.0, slo_tbt_s=0.2)
        self.replies.admit(request_id, "bench:outputs", {"admitted_s": time.time()})
        self.live.add(request_id)

    def iterate(self, feed: bool) -> None:
        """One worker iteration; ``feed``: keep 2-8 requests live, abort one now and then."""
        rng = self.rng
        if feed and (len(self.live) < 2 or (len(self.live) < 8 and rng.random() < 0.4)):
            self.add()
        if feed and self.live and rng.random() < 0.01:
            self.engine.abort(rng.choice(sorted(self.live)))
        t_start = time.perf_counter()
        result = self.engine.step()
        self.num_iterations += 1
        for output in result.outputs:
            if output.finished:
                self.live.discard(output.request_id)
        self.replies.token_batches(result.outputs)
        identity = WorkerIdentity("bench-worker", self.planner.epoch, 1)
        iteration = result.snapshot.iteration
        base = self.planner.delta_base(iteration)
        elapsed = time.perf_counter() - t_start
        encode(
            state_snapshot(
                self.engine.kv, identity, result, elapsed, self.planner.source, self.deltas, base
            )
        )
        if self.num_iterations % 100 == 0:  # the lifecycle writes (no Redis here)
            self.replies.take_lifecycle()

    def drain(self) -> None:
        """Run until nothing is live and no copy is in flight (a stall raises)."""
        for _ in range(MAX_DRAIN_ITERATIONS):
            if not self.engine.has_unfinished():
                break
            self.iterate(feed=False)
        else:
            raise RuntimeError(f"the engine did not drain: {self.engine.stats}")
        self.engine.kv.drain()
        self.replies.take_lifecycle()
        if self.live or len(self.replies):
            raise RuntimeError(f"drained with {len(self.live)} live requests left")


def build_loop(model: str, policy: str, seed: int, executor: str = "model") -> Loop:
    """The worker's engine over ``model`` (``executor`` "null": no model computes)."""
    loaded = load_model(model)
    knobs = Knobs(policy=policy, b_xfer=8)
    planner = HybridPlanner(knobs, max_age_iterations=8, epoch="bench")
    rng = random.Random(seed)
    serving = Serving(planner=RandomRotations(planner, rng, p_out=0.05))
    engine = build_engine(loaded, CONFIG, knobs, serving)
    if executor == "null":
        engine.executor = NullExecutor()
    return Loop(engine, planner, rng)


@dataclass(frozen=True, slots=True)
class Sample:
    iteration: int
    traced_bytes: int
    num_objects: int
    rss_bytes: int
    num_cached_blocks: int = 0  # in both prefix indexes (printed: they fill and evict)


def take_sample(iteration: int, num_cached: int = 0) -> Sample:
    gc.collect()
    traced, _ = tracemalloc.get_traced_memory()
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    rss = pages * os.sysconf("SC_PAGE_SIZE")
    return Sample(iteration, traced, len(gc.get_objects()), rss, num_cached)


PLATEAU_STEP = 500  # iterations between checks of the prefix indexes' size in warm-up
PLATEAU_CHECKS = 4  # checks without a new largest size: the indexes are as full as they get


def num_cached_blocks(loop: Loop) -> int:
    stats = loop.engine.kv.stats()
    return stats.num_cached_hbm_blocks + stats.num_cached_dram_blocks


def measure(loop: Loop, iterations: int, warmup: int, num_samples: int) -> list[Sample]:
    """Warm up: ``warmup`` iterations, then on until the prefix indexes stop growing (their
    largest size not passed in PLATEAU_CHECKS checks, at most 4x ``warmup`` in all: each
    cached block holds ~200 B, and on a slow host the DRAM index filled later, seen in CI as
    37 KiB of growth after 7,000); then sample (drained) every ``iterations / num_samples``
    iterations; the drains' iterations count."""
    while loop.num_iterations < warmup:
        loop.iterate(feed=True)
    loop.drain()
    largest, num_flat = num_cached_blocks(loop), 0
    while num_flat < PLATEAU_CHECKS and loop.num_iterations < 4 * warmup:
        target = loop.num_iterations + PLATEAU_STEP
        while loop.num_iterations < target:
            loop.iterate(feed=True)
        loop.drain()
        size = num_cached_blocks(loop)
        largest, num_flat = (size, 0) if size > largest else (largest, num_flat + 1)
    loop.warmup_iterations = loop.num_iterations
    start = loop.num_iterations
    samples = [take_sample(0, num_cached_blocks(loop))]
    interval = max(1, iterations // max(1, num_samples))
    while loop.num_iterations - start < iterations:
        target = min(start + iterations, loop.num_iterations + interval)
        while loop.num_iterations < target:
            loop.iterate(feed=True)
        loop.drain()
        samples.append(take_sample(loop.num_iterations - start, num_cached_blocks(loop)))
    return samples


def per_10k(samples: list[Sample], attribute: str) -> float:
    """Least-squares growth of ``attribute`` per 10,000 iterations."""
    xs = np.array([s.iteration for s in samples], np.float64)
    ys = np.array([getattr(s, attribute) for s in samples], np.float64)
    if len(xs) < 2 or xs[-1] == xs[0]:
        return 0.0
    return float(np.polyfit(xs, ys, 1)[0] * 10_000)


def report(samples: list[Sample], loop: Loop, seconds: float, load: tuple[float, ...]) -> str:
    first, last = samples[0], samples[-1]
    print(f"{'iteration':>10} {'traced KiB':>11} {'objects':>9} {'RSS MiB':>8} {'cached':>7}")
    for s in samples:
        print(
            f"{s.iteration:>10} {s.traced_bytes / KIB:>11.1f} {s.num_objects:>9} "
            f"{s.rss_bytes / KIB / KIB:>8.1f} {s.num_cached_blocks:>7}"
        )
    stats, kv = loop.engine.stats, loop.engine.kv.stats()
    print(
        f"requests added {loop.num_added}, rotations out {stats.num_rotations_out}, "
        f"preemptions {stats.num_preemptions}, DRAM blocks stored/loaded "
        f"{kv.num_blocks_stored}/{kv.num_blocks_loaded}; warm-up {loop.warmup_iterations} "
        f"iterations, prefix indexes at the end: HBM {kv.num_cached_hbm_blocks}/"
        f"{kv.num_hbm_blocks}, DRAM {kv.num_cached_dram_blocks}/{kv.num_dram_blocks}"
    )
    print(
        f"growth per 10k iterations: traced {per_10k(samples, 'traced_bytes') / KIB:.2f} KiB, "
        f"objects {per_10k(samples, 'num_objects'):.1f}, "
        f"RSS {per_10k(samples, 'rss_bytes') / KIB:.1f} KiB"
    )
    iterations = last.iteration
    print(
        f"{iterations} iterations in {seconds:.1f} s ({seconds / max(1, iterations) * 1e3:.2f}"
        f" ms each, tracemalloc on); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    return (
        f"RESULT worker_memory iterations={iterations} "
        f"traced_growth_kib={(last.traced_bytes - first.traced_bytes) / KIB:.1f} "
        f"objects_growth={last.num_objects - first.num_objects} "
        f"load_avg={load[0]:.2f}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--iterations", type=int, default=20_000, help="measured iterations, after warm-up")
    add("--warmup", type=int, default=3_000, help="iterations before the first sample")
    add("--samples", type=int, default=10, help="samples after the first")
    add("--model", default=None, help="a model path (default: stories260K, else tiny-random)")
    add("--policy", default="lvf", help="the worker's policy (knobs.policy)")
    add("--executor", choices=("model", "null"), default="model", help="null: no model runs")
    add("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.iterations < 1 or args.warmup < 0 or args.samples < 1:
        raise SystemExit("--iterations and --samples must be >= 1, --warmup >= 0")
    torch.set_num_threads(1)
    model = args.model or (str(STORIES) if STORIES.exists() else "tiny-random")
    print(f"model {model} (executor {args.executor}), policy {args.policy}, {CONFIG}")
    was_tracing = tracemalloc.is_tracing()
    tracemalloc.start()
    loop = build_loop(model, args.policy, args.seed, args.executor)
    t_start = time.perf_counter()
    try:
        samples = measure(loop, args.iterations, args.warmup, args.samples)
    finally:
        loop.engine.close()
        if not was_tracing:
            tracemalloc.stop()
    print(report(samples, loop, time.perf_counter() - t_start, os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
