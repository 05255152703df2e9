"""SLO capacity for bench/sched_compare.py: per trace, profile, policy and seed of arrivals, the
highest rate at which >= 90 % of requests meet both their TTFT and TPOT SLOs
(``lab/sim/capacity.py``; DistServe's goodput, ``vllm bench sweep serve_sla``'s search).

Every policy is searched on the same seeds (the same arrivals at a given rate), from
``START_X_KNEE`` times vllm's knee (its 50 % TTFT rate; 90 % of both SLOs lies below it), stepping
by 1.5 until bracketed and bisecting to ``tol``. The headline per trace and profile is the
capacity ratio lvf / vllm: sum of lvf's capacities over the seeds / sum of vllm's, with a
percentile-bootstrap 95 % interval over the seeds (``lab/stats.py``, paired by seed).

Ceilings (``--ceilings``): two what-if variants searched on the same seeds, printed as ratios
to vllm beside the headline: ``lvf-free-link`` (lvf with the host link ``FREE_LINK_SCALE``
times faster: what SLO-aware rotation reaches when moving KV costs nothing) and
``vllm-ample-hbm`` (vllm with ``AMPLE_HBM_GIB`` of HBM: the capacity memory takes from it).
Rotation does not raise decode throughput (every decoded token's KV must sit in HBM, so the
HBM bounds the batch whatever the order): where even the free-link ceiling stays under a
target, what is missing is throughput, not link time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from bench.sched_judge import AMPLE_HBM_GIB
from lab.costmodel import with_link_scale
from lab.crossing import CAPACITY_METRIC, CAPACITY_TARGET, CrossingSearch
from lab.sim.capacity import run_searches
from lab.sim.sweep import SweepJob
from lab.stats import Interval, mean_interval, ratio_interval

FREE_LINK_SCALE = 1000.0  # 51 TB/s each way on the h200: a rotation's copies take ~no time
CEILINGS = ("lvf-free-link", "vllm-ample-hbm")
START_X_KNEE = 0.7
START_STEP = 1.5
CapKey = tuple[str, str, str, int]  # trace, profile, policy, seed
JobFn = Callable[[str, str, float, str, int], SweepJob]  # trace, profile, rps, policy, seed


@dataclass(frozen=True, slots=True)
class CapacityCell:
    """One trace and profile: each policy's capacity per seed (req/s, seeds in order)."""

    workload: str
    profile: str
    by_policy: dict[str, list[float]]

    def capacity(self, policy: str) -> Interval:
        return mean_interval(self.by_policy[policy])

    def ratio(self, policy: str = "lvf", base: str = "vllm") -> Interval:
        return ratio_interval(self.by_policy[policy], self.by_policy[base])

    def key(self) -> str:
        """``<trace>_<gpu>`` as RESULT keys name it (``azure_code_h200``)."""
        return f"{self.workload}_{self.profile.split('-')[0]}".replace("-", "_")


def ceiling_job(job: SweepJob) -> SweepJob:
    """``job`` as its ceiling variant when its label names one (``CEILINGS``); else ``job``."""
    setup = job.setup
    if job.label == "lvf-free-link":
        setup = replace(setup, profile=with_link_scale(setup.profile, FREE_LINK_SCALE))
        return replace(job, policy="lvf", setup=setup)
    if job.label == "vllm-ample-hbm":
        return replace(job, policy="vllm", setup=replace(setup, hbm_kv_gib=AMPLE_HBM_GIB))
    return job


def run_capacity(
    cells: Sequence[tuple[str, str, float]],
    policies: Sequence[str],
    seeds: Sequence[int],
    tol: float,
    make_job: JobFn,
    workers: int,
    metric: str = CAPACITY_METRIC,
) -> list[CapacityCell]:
    """Capacity of every policy on every (trace, profile, vllm's knee) of ``cells``: the
    highest rate where ``metric`` (a row's attainment: both SLOs, or both without a stall)
    reaches ``CAPACITY_TARGET``."""
    searches: dict[CapKey, CrossingSearch] = {
        (name, profile, policy, seed): CrossingSearch(
            START_X_KNEE * knee, CAPACITY_TARGET, tol, START_STEP
        )
        for name, profile, knee in cells
        for policy in policies
        for seed in seeds
    }

    def job(key: CapKey, rate: float) -> SweepJob:
        name, profile, policy, seed = key
        if policy in CEILINGS:
            base = make_job(name, profile, rate, policy.split("-")[0], seed)
            return ceiling_job(replace(base, label=policy))
        return make_job(name, profile, rate, policy, seed)

    def show(key: CapKey, rate: float, row: dict[str, Any]) -> None:
        name, profile, policy, seed = key
        print(
            f"  capacity {name} {profile} {policy} seed {seed} @ {rate:.3g}: "
            f"{metric} {100 * row[metric]:.1f} %",
            flush=True,
        )

    run_searches(searches, job, metric, workers, show)
    return [
        CapacityCell(
            name,
            profile,
            {p: [searches[(name, profile, p, s)].capacity() for s in seeds] for p in policies},
        )
        for name, profile, _ in cells
    ]


def print_capacity(cells: Sequence[CapacityCell], metric: str = CAPACITY_METRIC) -> None:
    print(f"\n== SLO capacity (highest rate with >= {100 * CAPACITY_TARGET:.0f} % of requests")
    stall = ", no gap over 10 x S_B" if metric == "stall_free_attainment" else ""
    print(f"   meeting TTFT and TPOT{stall}; mean over seeds [95 % bootstrap interval])")
    for c in cells:
        parts = []
        for policy in c.by_policy:
            iv = c.capacity(policy)
            parts.append(f"{policy} {iv.value:.3g} [{iv.lo:.3g}, {iv.hi:.3g}]")
        line = f"{c.workload:12s} {c.profile:16s} " + "  ".join(parts)
        for policy in ("lvf", *CEILINGS):
            if {policy, "vllm"} <= set(c.by_policy):
                r = c.ratio(policy)
                line += f"  {policy}/vllm {r.value:.2f}x [{r.lo:.2f}, {r.hi:.2f}]"
        print(line)


def capacity_fields(
    cells: Sequence[CapacityCell], metric: str = CAPACITY_METRIC
) -> dict[str, float]:
    """``capacity_ratio_<trace>_<gpu>`` with ``_lo`` / ``_hi`` for the RESULT line, and with
    ``--ceilings`` ``capacity_free_link_<...>`` and ``capacity_ample_hbm_<...>`` (ratios to
    vllm); ``capacity_ratio_stall_free_<...>`` and so on under the stall-free metric."""
    out: dict[str, float] = {}
    names = {"lvf": "capacity_ratio", "lvf-free-link": "capacity_free_link"}
    names["vllm-ample-hbm"] = "capacity_ample_hbm"
    if metric == "stall_free_attainment":
        names = {policy: f"{name}_stall_free" for policy, name in names.items()}
    for c in cells:
        for policy, name in names.items():
            if {policy, "vllm"} <= set(c.by_policy):
                out |= c.ratio(policy).fields(f"{name}_{c.key()}")
    return out


def capacity_json(cells: Sequence[CapacityCell]) -> list[dict[str, Any]]:
    rows = []
    for c in cells:
        row: dict[str, Any] = {"trace": c.workload, "profile": c.profile}
        row["capacity_rps"] = c.by_policy
        row["capacity_mean"] = {p: c.capacity(p).value for p in c.by_policy}
        if {"lvf", "vllm"} <= set(c.by_policy):
            r = c.ratio()
            row["ratio_lvf_vllm"] = {"value": r.value, "lo": r.lo, "hi": r.hi}
        rows.append(row)
    return rows
