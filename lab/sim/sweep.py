"""Many simulations (policies x rates x settings), optionally on several processes.

Used by ``superinfer simulate`` (``lab/sim/cli.py``) and ``bench/sched_compare.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from lab.sessions import conversations
from lab.sim.setup import SimSetup
from lab.sim.simulator import ProgressFn, SimResult, run_simulation
from lab.traces import TraceRequest, load_trace
from shared.policy import Knobs


@dataclass(frozen=True, slots=True)
class SweepJob:
    """One simulation: a trace at one rate, one policy, one setup. ``label`` names the
    variant in tables (default: the policy)."""

    trace: str
    rps: float
    duration_s: float
    policy: str
    knobs: Knobs
    setup: SimSetup
    burstiness: float = 1.0
    seed: int = 0
    label: str = ""
    horizon_s: float | None = None  # stop the run at this virtual time (None: run to the end)
    turns: int = 0  # > 0: the trace regrouped into conversations of this many turns (sessions)
    hawkes: float = 0.0  # > 0: Hawkes arrivals of this branching ratio (generated traces only)
    hawkes_tau_s: float = 1.0

    @property
    def name(self) -> str:
        return self.label or self.policy


@functools.lru_cache(maxsize=16)
def _trace(
    spec: str,
    rps: float,
    duration_s: float,
    burstiness: float,
    seed: int,
    turns: int = 0,
    hawkes: float = 0.0,
    hawkes_tau_s: float = 1.0,
) -> tuple[TraceRequest, ...]:
    requests = load_trace(
        spec,
        rps=rps,
        duration_s=duration_s,
        num_requests=None,
        burstiness=burstiness,
        seed=seed,
        hawkes=hawkes,
        hawkes_tau_s=hawkes_tau_s,
    )
    return tuple(conversations(requests, turns, seed=seed) if turns else requests)


def details(job: SweepJob, result: SimResult) -> dict[str, Any]:
    """What a run's row leaves out: its variant, sizes and the simulator's own counters."""
    return {
        "label": job.name,
        "policy": job.policy,
        "rps": job.rps,
        "trace": job.trace,
        "seed": job.seed,
        "profile": job.setup.profile.name,
        "transfer": job.setup.transfer,
        "eager_sync": job.setup.eager_sync,
        "b_xfer": job.setup.b_xfer,
        "num_clipped": result.num_clipped,
        "num_rejected": result.num_rejected,
        "num_unfinished": result.num_unfinished,
        "num_iterations": result.num_iterations,
        "num_stalls": result.num_stalls,
        "virtual_s": result.virtual_s,
        "busy_s": result.busy_s,
        "wall_s": result.wall_s,
        "max_blocks_per_iteration": result.max_blocks_per_iteration,
        "b_xfer_median": _median(result.b_xfer_history),
        "leaked_hbm_blocks": result.leaked_hbm_blocks,
        "leaked_dram_blocks": result.leaked_dram_blocks,
        **result.prefix,
    }


def _median(values: list[int]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[len(ordered) // 2])


def run_job(
    job: SweepJob, on_progress: ProgressFn | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(row, details) of one job."""
    trace = _trace(
        job.trace,
        job.rps,
        job.duration_s,
        job.burstiness,
        job.seed,
        job.turns,
        job.hawkes,
        job.hawkes_tau_s,
    )
    result = run_simulation(
        trace,
        job.policy,
        job.knobs,
        job.setup,
        rps=job.rps,
        on_progress=on_progress,
        horizon_s=job.horizon_s,
    )
    return result.row, details(job, result)


DoneFn = Callable[[int, SweepJob, dict[str, Any]], None]


def run_sweep(
    jobs: Sequence[SweepJob],
    workers: int = 1,
    on_done: DoneFn | None = None,
    on_progress: Callable[[int], ProgressFn] | None = None,
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(row, details) per job, in job order. ``workers`` > 1 runs jobs in that many processes
    (then ``on_progress``, the per-job request counter factory, is not used)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    results: list[tuple[dict[str, Any], dict[str, Any]] | None] = [None] * len(jobs)
    if workers == 1 or len(jobs) <= 1:
        for index, job in enumerate(jobs):
            results[index] = run_job(job, on_progress(index) if on_progress else None)
            if on_done is not None:
                on_done(index, job, results[index][0])  # type: ignore[index]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(run_job, job): i for i, job in enumerate(jobs)}
            for future in as_completed(futures):
                index = futures[future]
                results[index] = future.result()
                if on_done is not None:
                    on_done(index, jobs[index], results[index][0])  # type: ignore[index]
    return [r for r in results if r is not None]
