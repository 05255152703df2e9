"""Stand-in workers: no model, real wire traffic. Each one keeps a request population (synthetic,
or replayed from a recorded snapshot's columns), advances it one decode token per iteration,
publishes a real ``StateSnapshot`` per iteration to the snapshot stream, reads its plan stream
and applies the newest plan of its epoch as the worker would (fresh when at most
``max_age_iterations`` old; else it counts the iteration as stalled: the worker would have
planned locally). Many run in one process (:class:`Fleet`: staggered groups, one pipelined
round trip per group and direction), so a bus and control planes can be loaded without GPUs.

    .venv/bin/python -m lab.standin --workers 8 --requests 1024 --rate 20 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from redis.asyncio import Redis

from shared import streams
from shared.bus import queue_snapshot, should_announce
from shared.policy.columns import ROTARY_CODE, RUNNING_CODE, WAITING_CODE, RequestColumns
from shared.protocol import ProtocolError, RotationPlan, StateSnapshot, decode, encode
from shared.protocol.convert import arrays_from_columns, table_from_arrays
from shared.protocol.delta import DeltaEncoder, EncodedRequests

BLOCK_SIZE = 16
HBM_FRACTION = 0.6  # of the population's KV that HBM holds: LVF has rotations to plan


class Population:
    """Requests as policy columns (running, waiting, rotary), advanced one token per
    iteration; a finished request is replaced by a new arrival (new handle)."""

    def __init__(
        self, columns: RequestColumns, rng: np.random.Generator, max_num_seqs: int | None = None
    ) -> None:
        self.rng = rng
        self.max_num_seqs = len(columns) if max_num_seqs is None else max_num_seqs
        self.c = {name: np.array(getattr(columns, name)) for name in _COLUMNS}
        self.ids = [str(i) for i in range(len(columns))]  # ids never travel
        self.next_seq = int(self.c["arrival_seq"].max(initial=-1)) + 1
        self.target = self.c["num_tokens"] + rng.integers(16, 512, len(columns))
        blocks = -(-self.target // BLOCK_SIZE)
        self.num_hbm_blocks = max(1, int(blocks.sum() * HBM_FRACTION))
        self.num_dram_blocks = int(blocks.sum() * 2)

    @classmethod
    def synthetic(cls, num: int, seed: int, max_num_seqs: int | None = None) -> Population:
        """Half running, a quarter waiting, a quarter rotary, as plan_latency's bench; with
        ``max_num_seqs`` (an engine's batch cap) that many run and the rest wait or are
        rotary, half each (an overloaded engine: most rows stay unchanged between
        iterations)."""
        rng = np.random.default_rng(seed)
        now = time.time()
        kind = np.arange(num) % 4
        codes = np.where(kind < 2, RUNNING_CODE, np.where(kind == 2, WAITING_CODE, ROTARY_CODE))
        if max_num_seqs is not None:
            codes = np.where(np.arange(num) % 2, ROTARY_CODE, WAITING_CODE)
            codes[: min(num, max_num_seqs)] = RUNNING_CODE
        running, rotary = codes == RUNNING_CODE, codes == ROTARY_CODE
        computed = np.where(codes != WAITING_CODE, rng.integers(16, 2001, num), 0)
        blocks = -(-computed // BLOCK_SIZE)
        columns = RequestColumns(
            request_ids=[""] * num,
            states=codes.astype(np.uint8),
            t_arr_s=now - rng.uniform(0, 30, num),
            t_run_s=np.where(running, now - rng.uniform(0, 10, num), np.nan),
            t_last_s=np.where(rotary, now - rng.uniform(0, 1, num), np.nan),
            slo_ttft_s=np.full(num, np.nan),
            slo_tbt_s=np.full(num, np.nan),
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
        return cls(columns, rng, max_num_seqs)

    def apply(self, plan: RotationPlan, now: float) -> None:
        """The plan's transitions, by handle (handles no longer here are skipped)."""
        c = self.c
        seq = c["arrival_seq"]
        moves = (
            (plan.rotate_out_seqs, RUNNING_CODE, ROTARY_CODE),
            (plan.preempt_seqs, RUNNING_CODE, WAITING_CODE),
            (plan.resume_seqs, ROTARY_CODE, RUNNING_CODE),
            (plan.admit_seqs, WAITING_CODE, RUNNING_CODE),
        )
        for seqs, source, target in moves:
            if not seqs:
                continue
            rows = np.nonzero(np.isin(seq, seqs) & (c["states"] == source))[0]
            c["states"][rows] = target
            blocks = c["num_blocks_hbm"][rows] + c["num_blocks_dram"][rows]
            if target == RUNNING_CODE:
                c["t_run_s"][rows] = now
                c["num_blocks_hbm"][rows], c["num_blocks_dram"][rows] = blocks, 0
            elif target == ROTARY_CODE:
                c["t_last_s"][rows] = now
                c["num_blocks_hbm"][rows], c["num_blocks_dram"][rows] = 0, blocks
            else:  # recompute: KV dropped
                c["num_computed_tokens"][rows] = 0
                c["num_blocks_hbm"][rows] = c["num_blocks_dram"][rows] = 0

    def advance(self, now: float) -> None:
        """One decode token per running request; finished ones leave, new arrivals wait."""
        c = self.c
        running = c["states"] == RUNNING_CODE
        c["num_computed_tokens"][running] = c["num_tokens"][running]
        c["num_tokens"][running] += 1
        c["num_output_tokens"][running] += 1
        c["t_first_s"][running & np.isnan(c["t_first_s"])] = now
        c["num_blocks_hbm"][running] = -(-c["num_tokens"][running] // BLOCK_SIZE)
        done = np.nonzero(running & (c["num_tokens"] >= self.target))[0]
        if len(done):
            num = len(done)
            c["states"][done] = WAITING_CODE
            c["t_arr_s"][done] = now
            c["t_run_s"][done] = c["t_last_s"][done] = c["t_first_s"][done] = np.nan
            c["num_output_tokens"][done] = 0
            c["num_tokens"][done] = self.rng.integers(16, 2001, num)
            c["num_computed_tokens"][done] = 0
            c["num_blocks_hbm"][done] = c["num_blocks_dram"][done] = 0
            c["arrival_seq"][done] = np.arange(self.next_seq, self.next_seq + num)
            self.next_seq += num
            self.target[done] = c["num_tokens"][done] + self.rng.integers(16, 512, num)

    def columns(self) -> RequestColumns:
        return RequestColumns(request_ids=self.ids, **self.c)


_COLUMNS = [name for name in RequestColumns.__dataclass_fields__ if name != "request_ids"]


@dataclass
class StandInStats:
    iterations: int = 0
    stalled: int = 0  # iterations without a fresh plan: the worker would have planned locally
    plans: int = 0  # plans of its epoch received
    duplicates: int = 0  # a second plan for a snapshot iteration already planned
    ages: list[int] = field(default_factory=list)  # newest plan's age at each iteration
    snapshot_bytes: int = 0  # encoded snapshots, summed
    deltas: int = 0  # snapshots sent as a delta


class StandIn:
    """One stand-in worker: its population, its epoch, its plan stream's read position."""

    def __init__(
        self,
        worker_id: str,
        population: Population,
        max_age_iterations: int = 4,
        deltas: bool = True,
    ) -> None:
        self.worker_id = worker_id
        self.deltas = DeltaEncoder() if deltas else None
        self.population = population
        self.max_age_iterations = max_age_iterations
        self.epoch = uuid.uuid4().hex[:12]
        self.iteration = 0
        self.plans_stream = streams.worker_plans_stream(worker_id)
        self.last_plan_id: Any = "0-0"
        self.newest: RotationPlan | None = None
        self._applied = True
        self._planned: set[int] = set()
        self.source = "local"
        self.announced_s: float | None = None
        self.stats = StandInStats()

    def take_plans(self, entries: list[tuple[Any, dict[bytes, bytes]]]) -> None:
        for entry_id, fields in entries:
            self.last_plan_id = entry_id
            try:
                plan = decode(fields.get(b"m", b""), RotationPlan)
            except ProtocolError:
                continue
            if plan.epoch != self.epoch:
                continue
            self.stats.plans += 1
            if plan.snapshot_iteration in self._planned:
                self.stats.duplicates += 1
            self._planned.add(plan.snapshot_iteration)
            if self.newest is None or plan.snapshot_iteration > self.newest.snapshot_iteration:
                self.newest, self._applied = plan, False

    def step(self, now: float, iteration_time_s: float) -> bytes:
        """Iteration ``self.iteration``: take the newest plan if fresh (else count a stall),
        advance, and return the encoded snapshot to publish."""
        plan, n = self.newest, self.iteration
        age = None if plan is None else n - plan.snapshot_iteration
        stats = self.stats
        stats.iterations += 1
        if age is not None:
            stats.ages.append(age)
        fresh = age is not None and 0 <= age <= self.max_age_iterations
        self.source = "remote" if fresh else "local"
        if plan is None or not fresh:
            stats.stalled += 1
        elif not self._applied:
            self.population.apply(plan, now)
            self._applied = True
        self.population.advance(now)
        self.iteration += 1
        self._planned.discard(n - 4 * self.max_age_iterations - 64)  # bounded memory
        base = plan.snapshot_iteration if fresh and plan is not None and age else None
        msg = self.snapshot(n, now, iteration_time_s, base)
        data = encode(msg)
        stats.snapshot_bytes += len(data)
        stats.deltas += msg.delta is not None
        return data

    def snapshot(
        self, iteration: int, now: float, iteration_time_s: float, base: int | None = None
    ) -> StateSnapshot:
        """The population as iteration ``iteration``'s snapshot (a delta against ``base``
        when this stand-in sends deltas and that pays)."""
        pop = self.population
        c = pop.c
        used_hbm = int(c["num_blocks_hbm"].sum())
        used_dram = int(c["num_blocks_dram"].sum())
        arrays = arrays_from_columns(pop.columns())
        if self.deltas is None:
            encoded = EncodedRequests(table_from_arrays(arrays), None)
        else:
            encoded = self.deltas.encode(iteration, arrays, base)
        return StateSnapshot(
            self.worker_id,
            self.epoch,
            iteration,
            now,
            encoded.requests,
            num_free_hbm_blocks=max(0, pop.num_hbm_blocks - used_hbm),
            num_free_dram_blocks=max(0, pop.num_dram_blocks - used_dram),
            num_hbm_blocks=pop.num_hbm_blocks,
            num_dram_blocks=pop.num_dram_blocks,
            block_size=BLOCK_SIZE,
            block_bytes=2 << 20,
            max_num_batched_tokens=8192,
            max_num_seqs=pop.max_num_seqs,
            b_xfer_blocks=256,
            iteration_time_s=iteration_time_s,
            link_bytes_per_s=5e10,
            plan_source=self.source,
            delta=encoded.delta,
        )

    def reset_stats(self) -> None:
        self.stats = StandInStats()


class Fleet:
    """Stand-ins driven together at ``rate`` iterations/s each, in ``groups`` staggered groups
    (real workers are not in step): per tick, one XREAD of the group's plan streams and one
    pipeline of its snapshots. ``late_ticks`` counts ticks that started a period late (the
    process could not keep the rate: its figures then understate the load)."""

    def __init__(self, redis: Redis, standins: list[StandIn], rate: float, groups: int = 5):
        self.redis = redis
        self.standins = standins
        self.period_s = 1.0 / rate
        self.groups = max(1, min(groups, len(standins)))
        self.late_ticks = 0

    async def run(self, stop: asyncio.Event) -> None:
        tick_s = self.period_s / self.groups
        t0 = time.monotonic()
        k = 0
        while not stop.is_set():
            await self._tick(self.standins[k % self.groups :: self.groups])
            k += 1
            delay = t0 + k * tick_s - time.monotonic()
            if delay < -self.period_s:
                self.late_ticks += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, delay))

    async def _tick(self, group: list[StandIn]) -> None:
        response: Any = await self.redis.xread(
            {s.plans_stream: s.last_plan_id for s in group}, count=64
        )
        by_stream = {s.plans_stream.encode(): s for s in group}
        for stream, entries in response or []:
            by_stream[stream].take_plans(entries)
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            for standin in group:
                data = standin.step(now, self.period_s)
                announce = should_announce(standin.announced_s, standin.source == "local", now)
                standin.announced_s = now if announce else standin.announced_s
                queue_snapshot(pipe, standin.worker_id, data, now, announce)
            await pipe.execute()

    def reset_stats(self) -> None:
        self.late_ticks = 0
        for standin in self.standins:
            standin.reset_stats()

    def totals(self) -> StandInStats:
        total = StandInStats()
        for standin in self.standins:
            s = standin.stats
            total.iterations += s.iterations
            total.stalled += s.stalled
            total.plans += s.plans
            total.duplicates += s.duplicates
            total.ages.extend(s.ages)
            total.snapshot_bytes += s.snapshot_bytes
            total.deltas += s.deltas
        return total


def make_fleet(
    redis: Redis,
    num_workers: int,
    num_requests: int,
    rate: float,
    prefix: str = "standin",
    deltas: bool = True,
    max_num_seqs: int | None = None,
) -> Fleet:
    standins = [
        StandIn(f"{prefix}-{i}", Population.synthetic(num_requests, i, max_num_seqs), deltas=deltas)
        for i in range(num_workers)
    ]
    return Fleet(redis, standins, rate)


async def _main(args: argparse.Namespace) -> None:
    redis = Redis.from_url(args.redis_url)
    fleet = make_fleet(redis, args.workers, args.requests, args.rate)
    stop = asyncio.Event()
    task = asyncio.create_task(fleet.run(stop))
    await asyncio.sleep(args.duration)
    stop.set()
    await task
    await redis.aclose()
    t = fleet.totals()
    ages = np.array(t.ages or [0])
    print(
        f"iterations {t.iterations} stalled {t.stalled} plans {t.plans} duplicates "
        f"{t.duplicates} plan_age_p50 {np.percentile(ages, 50):.0f} "
        f"p99 {np.percentile(ages, 99):.0f} late_ticks {fleet.late_ticks}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--rate", type=float, default=20.0, help="iterations/s per worker")
    parser.add_argument("--duration", type=float, default=10.0)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
