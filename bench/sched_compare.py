"""Scheduling policies compared in virtual time: the real engine, KV managers and policies over
every trace of the kit, with the cost model of each GPU (lab/sim).

What runs by default:

- traces: ShareGPT-8k and arXiv-summarization length stats (generated Poisson arrivals), the
  Azure LLM code trace and the Mooncake synthetic trace (their real arrival times, rescaled to
  each rate); ``--trace`` (repeatable) runs a kit name (``sharegpt``, ``azure-code``,
  ``mooncake``, ``arxiv``) or any trace file instead; ``--traces-dir`` is the kit's folder;
- profiles: h200-llama3-8b (PCIe, 51 GB/s each way) and gh200-llama3-8b (NVLink-C2C, 180);
- policies vllm and lvf (``--all-policies`` adds vllm-priority, swap, edf), default knobs,
  B_xfer auto, 40 s of arrivals (``--duration``);
- rates, per trace and profile: first the *knee*, the rate where vllm's TTFT attainment falls
  under 50 %, by a vllm-only search: probe a start rate, step up or down until the 50 % line is
  bracketed, bisect geometrically until the bracket is within 10 %. It starts at the table's
  knee (two probes when the table still holds: 16 vllm runs, ~25 s on one core); a trace not in
  the table starts at half its prefill-bound rate (FLOP rate / mean prompt) and steps by 2x.
  Then the sweep 0.25, 0.5, 0.75, 1, 1.25, 1.5 and 2x the knee;
- ablation (``--no-ablation`` skips it): at the ShareGPT rate judgment (b) used, lvf on the naive
  transfer engine, without eager sync, with min_residency 0.25-1 s, and the B_xfer sweep
  300-4800 on the GH200 (16 lvf runs).

- seeds: every judged rate runs on ``--seeds`` seeds of arrivals (default 5, quick 2; the same
  for every policy; a real trace's seed k is its k-th successive window of rows); the tables
  and judgments read the mean over the seeds, with percentile-bootstrap 95 % intervals paired
  by seed (bench/sched_judge.py);
- SLO capacity (``--no-capacity`` skips it, ``--capacity-only`` runs only it after the knees):
  per trace, profile, policy (vllm, lvf) and seed, the highest rate at which >= 90 % of
  requests meet both TTFT and TPOT (bench/sched_capacity.py); the headline per trace and
  profile is the ratio lvf / vllm with its interval;
- ``--hawkes N``: generated arrivals (ShareGPT, arXiv) from a Hawkes process of branching
  ratio N instead of Poisson (lab/arrivals.py); real traces keep their own.

``--quick`` is a smoke test: 10 s of arrivals, the table's knees (no search unless
``--search``), 0.5x and 2x of them, no ablation. A 40-s knee is less contended in 10 s windows
(2x is contended on ShareGPT and arXiv, not on Azure), so (b) may read "no contended rate".
``--calibrate-only`` runs only the search.

KV pools (why these sizes): scaled down from a real H200/GH200 (where an 8B model leaves
~100 GB for KV) so that HBM, not compute, binds first: the regime SuperInfer targets. The test:
vllm's knee with the chosen HBM is at most ~2/3 of its knee with ample HBM (128 GiB: then
compute or the trace's bursts bind). Measured 2026-12-01 with this bench's search
(``--calibrate-only [--hbm-gib N --trace NAME]``), vllm, 40 s of arrivals, on the H200 (the
GH200's knees are 0-4 % higher); in brackets: TTFT attainment at rate:

| trace | HBM | knee | with ample HBM | other sizes and why |
|---|---|---|---|---|
| ShareGPT-8k | 16 GiB | 8.9 (8.1: 64 %, 8.9: 49 %) | 16.6 (0.53x) | ~48 mean requests of |
| | | | | 2,300 + 440 tokens; 8 GiB: 5.5 |
| Azure code | 2 GiB | 6.7 (6.1: 58 %, 6.7: 50 %) | 10.3 (0.65x) | outputs are short (28 tokens): |
| | | | | requests leave HBM fast and the bursty arrivals bind soon after; 4 GiB: 8.9 |
| | | | | (0.87x, too close to say memory binds first) |
| arXiv-4k | 8 GiB | 8.1 (7.4: 75 %, 8.1: 50 %) | 17.1 (0.47x) | ~22 requests of 2,600 + 290 |
| | | | | tokens (outputs up to 3.3k); 16 GiB: 11.4 (0.67x) |
| Mooncake | 16 GiB | 0.90 (0.86: 86 %, 0.95: 14 %) | 1.91 at 48 GiB (0.47x) | prompts of 15k |
| | | | | tokens; HBM must hold the longest request of the rows used, else the simulator |
| | | | | shortens it: 56k tokens (6.9 GiB) in the first 150 rows, 83k (10.1 GiB) in 240 |
| | | | | (2x the knee uses 73); 12 GiB: 0.90 too; 8 GiB: 0.45 (vllm's recompute thrashes) |

DRAM is 8x HBM (the paper's host pool is ~3x its HBM; 8x leaves room for most rotary requests;
when it is full, a rotation falls back to recompute). A trace not in the table gets the
smallest power-of-two GiB holding both its longest request and 16 mean requests (of its first
1,000 rows); ``--hbm-gib`` sets every trace's HBM (then every knee is searched).

Prefix caching (``--prefix-caching off|hbm|both``, default hbm since 2026-12-08: figures before
it ran with off, which cost the vllm baseline ~5 % of its capacity): every run caches prefixes, vllm
in HBM only (vLLM V1's default; it has no DRAM tier), lvf with what is asked (``both``: HBM and
the DRAM tier's synced copies). The kit's traces other than Mooncake carry no content, so their
prompts never share a prefix: the cache then only saves the recompute of preempted requests
(vllm's own preemptions). The knee search runs with the same setting.

Reference (``--no-reference`` skips it): at each (b) point, one vllm run with
``AMPLE_HBM_GIB`` of HBM. Its TTFT attainment less vllm's at the bench's HBM is what memory
costs vllm there (``memory_gap_pts``); where the trace's bursts or compute bind, that gap is
small and a memory policy that keeps requests in arrival order (LVF ranks waiting requests by
lag, i.e. by age within a class) cannot gain much more than it. Printed under each (b) line
with the share of it lvf wins back.

Judgments (PASS/FAIL lines): (a) at every rate, lvf's goodput and output tokens/s are >= 0.95x
vllm's; (b) at a contended rate (vllm TTFT attainment < 50 %), lvf's TTFT attainment is >=
vllm's + 40 points on the GH200 and + 20 on the H200 over the gain's whole interval, with TBT
attainment at most 5 points lower and tokens/s >= 0.98x. (b) is required on ShareGPT and Azure
code and on every ``--trace`` file not in the table; Mooncake and arXiv print it for
information. Per trace and profile, (b) takes the contended rate meeting the TBT and tokens/s
conditions with the largest TTFT gain (else the one with the largest gain). The last line,
``RESULT sched_compare``: ``worst_goodput_ratio`` and ``worst_tput_ratio`` (minima over every
trace, profile and rate; 1.0 where both are 0), ``gh200_gain_pts`` and ``h200_gain_pts`` (per
profile, the minimum over the required traces of their (b) gain; nan where one has no contended
rate), ``tbt_delta_pts`` (the worst lvf - vllm TBT attainment difference at those points) and
``*_memory_gap_pts`` (the reference gap at the point of each profile's headline gain; nan
without the reference), then ``*_gain_pts_lo``/``_hi`` (the headline gains' intervals),
``gap_share_<trace>_<gpu>`` with ``_lo``/``_hi`` (lvf's gain / the memory gap at each (b) point
whose gap is >= 20 points) and ``capacity_ratio_<trace>_<gpu>`` with ``_lo``/``_hi``.

Runs stop at a horizon of max(3x, +60 s) the arrival window (arXiv's longest outputs take ~50 s
alone); unfinished requests count as SLO misses (a thrashing policy can take far longer to drain
than the others). Wall time: ``--quick`` 27-44 s on 1 worker (shared 2-core host); the default
run is an estimated 750 s of simulation (the search ~25 s; lvf at 40 s: 3-26 s a run, vllm
0.2-3 s; the ablation ~320 s), ~7-8 min on 2 free cores with ``--workers 2``
(``--all-policies`` adds ~6 min), all for one seed: 5 seeds take about 5x the main sweep's
time; the capacity searches (5 seeds) took 911 s with the knee search on 2 cores. The wall time
is printed before the RESULT line.

    .venv/bin/python bench/sched_compare.py [--quick] [--out bench/out] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sched_capacity import (
    CEILINGS,
    CapacityCell,
    capacity_fields,
    capacity_json,
    print_capacity,
    run_capacity,
)
from bench.sched_judge import (
    AMPLE_HBM_GIB,
    CONTENDED,
    GH200,
    H200,
    PROFILES,
    Judgment,
    Pair,
    Run,
    fields_text,
    finite,
    judge,
    make_pairs,
    merge_seeds,
    pct,
    result_line,
    summarize,
)
from lab.costmodel import load_profile
from lab.crossing import CrossingSearch
from lab.sim.capacity import run_searches
from lab.sim.setup import GIB, ROTATING_POLICIES, SimSetup
from lab.sim.sweep import SweepJob, run_sweep
from lab.traces import has_real_arrivals, load_trace
from shared.policy import Knobs

REPO = Path(__file__).resolve().parents[1]
_KIT = os.environ.get("SUPERINFER_KIT")
TRACES = Path(_KIT) / "traces" if _KIT else REPO.parent / "shared" / "traces"
MAIN_POLICIES = ("vllm", "lvf")
PEER_POLICIES = ("vllm-priority", "swap", "edf")
RATE_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
QUICK_FACTORS = (0.5, 2.0)
DURATION_S, QUICK_DURATION_S = 40.0, 10.0
DRAM_PER_HBM = 8.0
SEARCH_TOL, QUICK_SEARCH_TOL = 1.1, 1.5  # stop when the bracket's hi / lo is at most this
STATS_ROWS = 1000  # rows read to size a trace not in the table
AUTO_HBM_REQUESTS = 16
B_XFER_SWEEP = (300, 1200, 2400, 4800)
RESIDENCY_SWEEP = (0.25, 0.5, 1.0)  # seconds; 0 is the paper's LVF (the main rows)
NUM_SEEDS, QUICK_SEEDS = 5, 2


@dataclass(frozen=True, slots=True)
class Workload:
    """One trace and its pools. ``knees``: vllm's 50 % TTFT rate per profile, measured at 40 s
    (the search's start and ``--quick``'s rates); empty for a trace not in the table."""

    name: str
    path: Path
    hbm_kv_gib: float
    knees: dict[str, float] = field(default_factory=dict)
    required: bool = True  # judgment (b) must pass on it
    start_rps: float = 1.0  # where a search without a table knee starts

    @property
    def dram_kv_gib(self) -> float:
        return DRAM_PER_HBM * self.hbm_kv_gib


# name, file, HBM GiB, knees (h200, gh200) at 40 s, (b) required; see the docstring's table
KIT = (
    ("sharegpt", "sharegpt_8k_filtered_stats_llama2_tokenizer.csv", 16.0, (8.9, 9.2), True),
    ("azure-code", "AzureLLMInferenceTrace_code_2023.csv", 2.0, (6.7, 6.9), True),
    ("mooncake", "mooncake_fast25_synthetic_trace.jsonl", 16.0, (0.9, 0.9), False),
    ("arxiv", "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", 8.0, (8.1, 8.4), False),
)


def kit_workloads(traces_dir: Path) -> list[Workload]:
    return [
        Workload(name, traces_dir / file, hbm, dict(zip(PROFILES, knees, strict=True)), req)
        for name, file, hbm, knees, req in KIT
    ]


def trace_stats(path: Path) -> tuple[float, float, int]:
    """(mean prompt, mean prompt + output, longest prompt + output) over the first rows."""
    reqs = load_trace(str(path), rps=1.0, duration_s=None, num_requests=STATS_ROWS)
    if not reqs:
        raise ValueError(f"{path}: no requests")
    totals = [r.input_len + r.output_len for r in reqs]
    return sum(r.input_len for r in reqs) / len(reqs), sum(totals) / len(totals), max(totals)


def other_workload(path: Path) -> Workload:
    """A trace not in the table: HBM sized by the docstring's rule, search from half the
    prefill-bound rate."""
    profile = load_profile(PROFILES[0])
    mean_prompt, mean_total, longest = trace_stats(path)
    tokens = max(longest, AUTO_HBM_REQUESTS * mean_total)
    gib = 2.0 ** max(0, math.ceil(math.log2(tokens * profile.kv_bytes_per_token / GIB)))
    per_token = getattr(profile, "prefill_s_per_token", None)  # the fitted rate, when set
    per_token = per_token or profile.flops_per_token / profile.peak_flops
    prefill_rps = 1.0 / (per_token * max(mean_prompt, 1.0))
    return Workload(path.stem[:16], path, gib, start_rps=_round_rate(0.5 * prefill_rps))


def select_workloads(args: argparse.Namespace) -> list[Workload]:
    """The kit, or ``--trace``'s entries (kit names, kit files, or other files)."""
    kit = kit_workloads(args.traces_dir)
    if not args.trace:
        chosen = kit
    else:
        by_name = {w.name: w for w in kit} | {w.path.name: w for w in kit}
        chosen = []
        for spec in args.trace:
            known = by_name.get(spec) or by_name.get(Path(spec).name)
            if known is not None and spec not in by_name:
                known = Workload(
                    known.name, Path(spec), known.hbm_kv_gib, known.knees, known.required
                )
            if known is None and not Path(spec).is_file():
                raise ValueError(f"--trace {spec}: neither a kit name nor a file")
            chosen.append(known or other_workload(Path(spec)))
    missing = [str(w.path) for w in chosen if not w.path.is_file()]
    if missing:
        raise ValueError(f"trace files not found: {', '.join(missing)} (see --traces-dir)")
    if len({w.name for w in chosen}) != len(chosen):
        raise ValueError(f"--trace names repeat: {', '.join(w.name for w in chosen)}")
    if args.hbm_gib is not None:  # the table's knees do not hold: search from the first one
        chosen = [
            Workload(w.name, w.path, args.hbm_gib, {}, w.required, w.knees.get(H200, w.start_rps))
            for w in chosen
        ]
    return chosen


def _round_rate(rps: float) -> float:
    return float(f"{rps:.2g}")


def horizon_s(duration_s: float) -> float:
    return max(3.0 * duration_s, duration_s + 60.0)


def make_job(
    w: Workload,
    profile: str,
    rps: float,
    policy: str,
    args: argparse.Namespace,
    label: str = "",
    knobs: Knobs | None = None,
    seed: int | None = None,
    **setup_changes: Any,
) -> SweepJob:
    fields: dict[str, Any] = {"b_xfer": "auto", **setup_changes}
    if args.prefix_caching != "off" and "prefix_caching" not in fields:
        fields["prefix_caching"] = args.prefix_caching  # a policy without DRAM gets HBM's
    setup = SimSetup(load_profile(profile), w.hbm_kv_gib, w.dram_kv_gib, **fields)
    return SweepJob(
        str(w.path),
        rps,
        args.duration,
        policy,
        knobs or Knobs(**args.knobs),
        setup,
        seed=args.seed if seed is None else seed,
        label=label or policy,
        horizon_s=horizon_s(args.duration),
        hawkes=0.0 if has_real_arrivals(str(w.path)) else args.hawkes,
    )


# --- the knee search (vllm only) -------------------------------------------------------------


def calibrate(
    workloads: Sequence[Workload], args: argparse.Namespace
) -> dict[tuple[str, str], CrossingSearch]:
    """Every (trace, profile)'s knee, where vllm's TTFT attainment crosses 50 %: a start from
    the table steps by ``tol`` (two probes when the table still holds), one from an estimate
    by 2; the searches advance in lock step over ``args.workers`` processes."""
    tol = QUICK_SEARCH_TOL if args.quick else SEARCH_TOL
    searches: dict[tuple[str, str], CrossingSearch] = {}
    for w in workloads:
        for profile in PROFILES:
            known = w.knees.get(profile)
            search = CrossingSearch(known or w.start_rps, CONTENDED, tol, tol if known else 2.0)
            if known is not None and not args.search:
                search.fixed = known
            searches[(w.name, profile)] = search
    by_name = {w.name: w for w in workloads}

    def job(key: tuple[str, str], rate: float) -> SweepJob:
        return make_job(by_name[key[0]], key[1], rate, "vllm", args)

    def show(key: tuple[str, str], rate: float, row: dict[str, Any]) -> None:
        name, profile = key
        attained = pct(row["ttft_attainment"])
        print(f"  search {name} {profile}: vllm @ {rate:.3g}: TTFT {attained} %", flush=True)

    run_searches(searches, job, "ttft_attainment", args.workers, show)
    return searches


def capacity_cells(
    workloads: Sequence[Workload],
    searches: dict[tuple[str, str], CrossingSearch],
    args: argparse.Namespace,
) -> list[CapacityCell]:
    """vllm's and lvf's SLO capacity on every trace and profile, over ``args.seeds`` seeds."""
    by_name = {w.name: w for w in workloads}
    cells = [(w.name, p, searches[(w.name, p)].crossing()) for w in workloads for p in PROFILES]
    tol = QUICK_SEARCH_TOL if args.quick else SEARCH_TOL

    def job(name: str, profile: str, rps: float, policy: str, seed: int) -> SweepJob:
        return make_job(by_name[name], profile, rps, policy, args, seed=seed)

    policies = (*MAIN_POLICIES, *CEILINGS) if args.ceilings else MAIN_POLICIES
    return run_capacity(cells, policies, seeds(args), tol, job, args.workers, args.capacity_metric)


def sweep_rates(knee: float, quick: bool) -> list[tuple[float, float]]:
    """(factor, rps) of the sweep around ``knee`` (rates rounded to 2 significant digits)."""
    out: dict[float, float] = {}
    for factor in QUICK_FACTORS if quick else RATE_FACTORS:
        out.setdefault(_round_rate(factor * knee), factor)
    return [(factor, rps) for rps, factor in sorted(out.items())]


# --- the main sweep --------------------------------------------------------------------------


Planned = tuple[str, str, float, SweepJob]


def main_plan(
    workloads: Sequence[Workload],
    searches: dict[tuple[str, str], CrossingSearch],
    args: argparse.Namespace,
) -> list[Planned]:
    policies = MAIN_POLICIES + (PEER_POLICIES if args.all_policies else ())
    return [
        (w.name, profile, factor, make_job(w, profile, rps, policy, args, seed=seed))
        for w in workloads
        for profile in PROFILES
        for factor, rps in sweep_rates(searches[(w.name, profile)].crossing(), args.quick)
        for policy in policies
        for seed in seeds(args)
    ]


def seeds(args: argparse.Namespace) -> list[int]:
    """The seeds of arrivals every judged rate and capacity search runs on."""
    return [args.seed + i for i in range(args.seeds)]


def run_plan(plan: Sequence[Planned], workers: int) -> list[Run]:
    """Every planned job; the likely slowest (rotating policies at the highest load) start first,
    so that no long run is left alone at the end."""
    order = sorted(
        range(len(plan)),
        key=lambda i: (plan[i][3].policy in ROTATING_POLICIES, plan[i][2]),
        reverse=True,
    )
    jobs = [plan[i][3] for i in order]
    done = 0

    def on_done(index: int, job: SweepJob, row: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        name, profile = plan[order[index]][:2]
        print(
            f"  [{done}/{len(jobs)}] {profile} {name} {job.name} @ {job.rps:g}: "
            f"TTFT {pct(row['ttft_attainment'])} % TBT {pct(row['tbt_attainment'])} %",
            flush=True,
        )

    results = run_sweep(jobs, workers, on_done)
    runs: dict[int, Run] = {}
    for i, (row, det) in zip(order, results, strict=True):
        name, profile, factor, job = plan[i]
        runs[i] = Run(name, profile, factor, job, row, det)
    return [runs[i] for i in range(len(plan))]


def with_ample_reference(
    judgments: Sequence[Judgment], workloads: Sequence[Workload], args: argparse.Namespace
) -> list[Judgment]:
    """Each (b) judgment with vllm's TTFT attainment at its rate when HBM is ample (one vllm
    run per point and seed): where even that is low, the trace's bursts or compute bind, and no
    memory policy that keeps requests in arrival order can gain much over vllm there."""
    points = [(j, j.point) for j in judgments if j.kind == "b" and j.point is not None]
    by_name = {w.name: w for w in workloads}
    plan: list[Planned] = []
    for j, p in points:
        ample = replace(by_name[j.workload], hbm_kv_gib=AMPLE_HBM_GIB)
        label = f"vllm ample HBM {j.profile}"
        for seed in seeds(args):
            job = make_job(ample, j.profile, p.rps, "vllm", args, label, seed=seed)
            plan.append((j.workload, j.profile, 0.0, job))
    refs: dict[int, list[float]] = {}
    per_point = [j for j, _ in points for _ in seeds(args)]
    for j, r in zip(per_point, run_plan(plan, args.workers), strict=True):
        refs.setdefault(id(j), []).append(r.row["ttft_attainment"])
    return [
        replace(j, ample_ttft=sum(refs[id(j)]) / len(refs[id(j)]), ample_seeds=tuple(refs[id(j)]))
        if id(j) in refs
        else j
        for j in judgments
    ]


# --- ablation (--ablation) -------------------------------------------------------------------


def key_rate(name: str, profile: str, judgments: Sequence[Judgment], runs: Sequence[Run]) -> float:
    """The rate (b) judged on this trace and profile, else its highest rate."""
    point = next(
        (
            j.point
            for j in judgments
            if j.kind == "b" and (j.workload, j.profile) == (name, profile)
        ),
        None,
    )
    if point is not None:
        return point.rps
    return max(r.job.rps for r in runs if (r.workload, r.profile) == (name, profile))


def ablation_plan(
    w: Workload, judgments: Sequence[Judgment], runs: Sequence[Run], args: argparse.Namespace
) -> list[Planned]:
    """lvf variants at the key rate of trace ``w`` (ShareGPT by default) on both profiles, and
    the fixed B_xfer sweep on the GH200."""
    plan: list[Planned] = []
    rates = {profile: key_rate(w.name, profile, judgments, runs) for profile in PROFILES}
    for profile, rps in rates.items():
        gpu = profile.split("-")[0]
        for label, changes in (
            ("naive+no-sync", {"transfer": "naive", "eager_sync": False}),
            ("naive", {"transfer": "naive"}),
            ("no-sync", {"eager_sync": False}),
        ):
            job = make_job(w, profile, rps, "lvf", args, f"{gpu} lvf {label}", **changes)
            plan.append((w.name, profile, 0.0, job))
        for residency_s in RESIDENCY_SWEEP:  # the extension knob (SUPERINFER.md's LVF: 0)
            knobs = Knobs(**{**args.knobs, "min_residency_s": residency_s})
            label = f"{gpu} lvf min_residency={residency_s:g}"
            plan.append(
                (w.name, profile, 0.0, make_job(w, profile, rps, "lvf", args, label, knobs))
            )
    for b in B_XFER_SWEEP[1:2] if args.quick else B_XFER_SWEEP:
        job = make_job(w, GH200, rates[GH200], "lvf", args, f"gh200 lvf B_xfer={b}", b_xfer=b)
        plan.append((w.name, GH200, 0.0, job))
    return plan


def ablation_summary(extra: Sequence[Run], runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Each ablation run against vllm's main row at the same trace, profile, rate and seed."""
    vllm = {
        (r.workload, r.profile, r.job.rps, r.job.seed): r.row for r in runs if r.job.name == "vllm"
    }
    out = []
    for r in extra:
        base = vllm[(r.workload, r.profile, r.job.rps, r.job.seed)]
        pair = Pair(r.workload, r.profile, 0.0, r.job.rps, base, r.row)
        out.append({"label": r.job.name, **pair.as_dict()})
    return out


# --- output ----------------------------------------------------------------------------------


def print_rows(title: str, runs: Sequence[Run]) -> None:
    print(f"\n== {title}")
    print(
        f"{'variant':28s} {'rps':>6s} {'xknee':>5s} {'TTFT%':>6s} {'TBT%':>6s} {'TPOT%':>6s} "
        f"{'good/s':>7s} {'tok/s':>7s} {'TTFTp99':>8s} {'TBTp99ms':>8s} {'rotate':>7s} "
        f"{'preempt':>7s} {'H2D GB':>7s} {'exposed':>7s} {'unfin':>5s} {'wall s':>6s}"
    )
    for run in runs:
        job, r, d = run.job, run.row, run.details
        p99 = "-" if r["ttft_p99_s"] is None else f"{r['ttft_p99_s']:.2f}"
        tbt99 = "-" if r["tbt_p99_s"] is None else f"{1000 * r['tbt_p99_s']:.0f}"
        factor = f"{run.factor:5.2f}" if run.factor else "    -"
        print(
            f"{job.name:28s} {job.rps:6g} {factor} {pct(r['ttft_attainment']):>6s} "
            f"{pct(r['tbt_attainment']):>6s} {pct(r['tpot_attainment']):>6s} "
            f"{r['goodput_rps']:7.2f} {r['output_tokens_per_s']:7.0f} {p99:>8s} {tbt99:>8s} "
            f"{r['rotations']:7d} {r['preemptions']:7d} {r['bytes_h2d'] / 1e9:7.0f} "
            f"{r['exposed_transfer_s']:7.2f} {d['num_unfinished']:5d} {d['wall_s']:6.1f}"
        )
    clipped = sum(run.details["num_clipped"] for run in runs)
    if clipped:
        print(f"  warning: {clipped} requests shortened to fit HBM (raise its size)")


def print_pairs(cell: Sequence[Pair]) -> None:
    print(
        f"  {'lvf/vllm':>8s} {'rps':>6s} {'xknee':>5s} {'vllmTTFT%':>9s} {'goodput':>8s} "
        f"{'tok/s':>7s} {'TTFT pts':>8s} {'TBT pts':>8s}"
    )
    for p in cell:
        mark = "contended" if p.contended else ""
        print(
            f"  {'':8s} {p.rps:6g} {p.factor:5.2f} {pct(p.vllm['ttft_attainment']):>9s} "
            f"{p.goodput_ratio:7.3f}x {p.tput_ratio:6.3f}x {p.ttft_gain_pts:+8.1f} "
            f"{p.tbt_delta_pts:+8.1f}  {mark}"
        )


def print_calibration(
    workloads: Sequence[Workload], searches: dict[tuple[str, str], CrossingSearch], quick: bool
) -> None:
    print("\n== knees (vllm TTFT attainment crosses 50 %) and the rates swept")
    for w in workloads:
        for profile in PROFILES:
            s = searches[(w.name, profile)]
            how = "table" if s.fixed is not None else "searched"
            if s.fixed is None and None in s.bracket():
                how = "NO 50 % CROSSING, searched"
            probes = " ".join(f"{rps:.3g}:{100 * a:.0f}%" for rps, a in sorted(s.probes))
            rates = ", ".join(f"{rps:g}" for _, rps in sweep_rates(s.crossing(), quick))
            print(
                f"{w.name:12s} {profile:16s} HBM {w.hbm_kv_gib:g} GiB DRAM {w.dram_kv_gib:g} GiB"
                f" knee {s.crossing():.3g} req/s ({how}{': ' + probes if probes else ''})"
                f"  rates {rates}"
            )


def _plots(out: Path, runs: Sequence[Run], workloads: Sequence[Workload]) -> None:
    from lab.sim.plot import plot_attainment

    policies = MAIN_POLICIES + PEER_POLICIES
    for w in workloads:
        for profile in PROFILES:
            sel = [
                r
                for r in runs
                if (r.workload, r.profile) == (w.name, profile) and r.job.name in policies
            ]
            if sel:
                plot_attainment(
                    [r.row for r in sel],
                    out / f"{w.name}_{profile}.png",
                    title=f"{w.name} on {profile} (HBM {w.hbm_kv_gib:g} GiB)",
                    labels=[r.job.name for r in sel],
                )


def calibration_json(
    workloads: Sequence[Workload], searches: dict[tuple[str, str], CrossingSearch], quick: bool
) -> list[dict[str, Any]]:
    return [
        {
            "trace": w.name,
            "path": str(w.path),
            "profile": profile,
            "hbm_kv_gib": w.hbm_kv_gib,
            "dram_kv_gib": w.dram_kv_gib,
            "required": w.required,
            "knee_rps": searches[(w.name, profile)].crossing(),
            "knee_from_table": searches[(w.name, profile)].fixed is not None,
            "probes": searches[(w.name, profile)].probes,
            "rates": [rps for _, rps in sweep_rates(searches[(w.name, profile)].crossing(), quick)],
        }
        for w in workloads
        for profile in PROFILES
    ]


def write_json(args: argparse.Namespace, out: dict[str, Any], wall_s: float) -> None:
    config = {
        "wall_s": wall_s,
        "duration_s": args.duration,
        "horizon_s": horizon_s(args.duration),
        "quick": args.quick,
        "seed": args.seed,
        "search": args.search,
        "all_policies": args.all_policies,
        "knobs": repr(Knobs(**args.knobs)),
        "prefix_caching": args.prefix_caching,
        "seeds": args.seeds,
        "hawkes": args.hawkes,
        "capacity": args.capacity,
    }
    path = args.out / "sched_compare.json"
    path.write_text(json.dumps({"config": config, **out}, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {path} (wall {wall_s:.0f} s)")


def report(
    args: argparse.Namespace,
    workloads: Sequence[Workload],
    runs: Sequence[Run],
    seed_runs: Sequence[Run],
    extra: Sequence[Run],
    judgments: Sequence[Judgment],
) -> dict[str, float]:
    """The tables (``runs``: over the seeds), the judgments and the summary (the RESULT line
    is left to the caller); the ablation is read against ``seed_runs`` of its seed."""
    pairs = make_pairs(runs)
    for w in workloads:
        for profile in PROFILES:
            cell = [r for r in runs if (r.workload, r.profile) == (w.name, profile)]
            cell.sort(key=lambda r: (r.job.rps, r.job.name != "vllm"))
            print_rows(
                f"{w.name} on {profile} (HBM {w.hbm_kv_gib:g} GiB, DRAM {w.dram_kv_gib:g} GiB,"
                f" B_xfer auto, {args.duration:g} s of arrivals)",
                cell,
            )
            print_pairs([p for p in pairs if (p.workload, p.profile) == (w.name, profile)])
    if extra:
        print_rows("ablation and B_xfer sweep (lvf variants at the key rate)", extra)
        for a in ablation_summary(extra, seed_runs):
            tput = "inf" if a["tput_ratio"] is None else f"{a['tput_ratio']:.3f}"
            print(
                f"  {a['label']:28s} vs vllm @ {a['rps']:g}: TTFT {a['ttft_gain_pts']:+.1f} pts,"
                f" TBT {a['tbt_delta_pts']:+.1f} pts, tok/s {tput}x"
            )
    print("\n== judgments")
    for j in judgments:
        print(j.line())
        if j.reference_line():
            print(j.reference_line())
    return summarize(pairs, judgments)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--quick", action="store_true", help="short smoke variant (2 rates, table knees)")
    add("--out", type=Path, default=Path(__file__).parent / "out")
    add("--workers", type=int, default=2, help="simulation processes")
    add(
        "--duration",
        type=float,
        default=None,
        help=f"seconds of arrivals (default {DURATION_S:g}, quick {QUICK_DURATION_S:g})",
    )
    add("--seed", type=int, default=0, help="the first seed of arrivals")
    add(
        "--seeds",
        type=int,
        default=None,
        help=f"seeds of arrivals per capacity search (default {NUM_SEEDS}, quick {QUICK_SEEDS})",
    )
    add(
        "--capacity",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="SLO capacity of vllm and lvf per trace and profile, over the seeds",
    )
    add("--capacity-only", action="store_true", help="only the knees and the capacity searches")
    add(
        "--capacity-metric",
        choices=("slo_attainment", "stall_free_attainment"),
        default="slo_attainment",
        help="what capacity counts: requests meeting TTFT and TPOT (vLLM's goodput), or those "
        "that also never pause more than 10 x S_B between two tokens",
    )
    add(
        "--ceilings",
        action="store_true",
        help="the capacity searches also run lvf with a free host link and vllm with ample HBM",
    )
    add(
        "--hawkes",
        type=float,
        default=0.0,
        help="generated arrivals (ShareGPT, arXiv) from a Hawkes process of this branching "
        "ratio (kernel mean 1 s) instead of Poisson; real traces keep their own",
    )
    add("--traces-dir", type=Path, default=TRACES, help=f"the kit's traces (default {TRACES})")
    add("--trace", action="append", default=[], help="a kit name or a trace file (repeatable)")
    add("--hbm-gib", type=float, default=None, help="HBM KV pool for every trace (DRAM 8x)")
    add("--all-policies", action="store_true", help=f"add {', '.join(PEER_POLICIES)}")
    add(
        "--ablation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="lvf variants and the B_xfer sweep at the key rate (default: yes, no with --quick)",
    )
    add(
        "--search",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="search the knees of the kit's traces (default: yes, no with --quick)",
    )
    add("--calibrate-only", action="store_true", help="only the knees and rates (vllm runs)")
    add(
        "--knobs",
        type=json.loads,
        default={},
        help="knob values for every run instead of the defaults, e.g. '{\"min_residency_s\": 1}'",
    )
    add("--no-plots", action="store_true")
    add(
        "--prefix-caching",
        choices=("off", "hbm", "both"),
        default="hbm",
        help="prefix caching for every run (default hbm, vLLM V1's default: without it the "
        "vllm baseline lost ~5 %% of its capacity, a recompute finding no block cached): vllm "
        "gets HBM's, a policy with a DRAM tier gets what is asked ('both': HBM + DRAM)",
    )
    add(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"at each (b) point, vllm with {AMPLE_HBM_GIB:g} GiB HBM (what memory costs vllm)",
    )
    args = parser.parse_args(argv)
    args.duration = args.duration or (QUICK_DURATION_S if args.quick else DURATION_S)
    args.search = not args.quick if args.search is None else args.search
    args.seeds = args.seeds or (QUICK_SEEDS if args.quick else NUM_SEEDS)
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.capacity_only and not args.capacity:
        parser.error("--capacity-only and --no-capacity contradict each other")
    if args.ceilings and not args.capacity:
        parser.error("--ceilings are capacity searches: not with --no-capacity")
    args.ablation = not args.quick if args.ablation is None else args.ablation
    return args


def results_json(
    seed_runs: Sequence[Run],
    runs: Sequence[Run],
    extra: Sequence[Run],
    judgments: Sequence[Judgment],
    summary: dict[str, float],
) -> dict[str, Any]:
    every = [*seed_runs, *extra]
    return {
        "results": [r.row for r in every],
        "details": [{**r.details, "trace_name": r.workload, "factor": r.factor} for r in every],
        "pairs": [p.as_dict() for p in make_pairs(runs)],
        "judgments": [
            {
                "kind": j.kind,
                "trace": j.workload,
                "profile": j.profile,
                "passed": j.passed,
                "required": j.required,
                "rps": None if j.point is None else j.point.rps,
                "text": j.text,
                "ample_hbm_vllm_ttft": j.ample_ttft,
                "memory_gap_pts": finite(j.memory_gap_pts),
            }
            for j in judgments
        ],
        "ablation": ablation_summary(extra, seed_runs),
        "summary": {k: finite(v) for k, v in summary.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        workloads = select_workloads(args)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    if args.hawkes:
        kept = [w.name for w in workloads if has_real_arrivals(str(w.path))]
        print(f"Hawkes arrivals (branching {args.hawkes:g}); real arrivals kept: {kept or 'none'}")
    searches = calibrate(workloads, args)
    print_calibration(workloads, searches, args.quick)
    out: dict[str, Any] = {"calibration": calibration_json(workloads, searches, args.quick)}
    if args.calibrate_only:
        write_json(args, out, time.perf_counter() - t0)
        return 0
    capacity = capacity_cells(workloads, searches, args) if args.capacity else []
    out["capacity"] = capacity_json(capacity)
    if args.capacity_only:
        print_capacity(capacity, args.capacity_metric)
        write_json(args, out, time.perf_counter() - t0)
        fields = capacity_fields(capacity, args.capacity_metric)
        print(f"RESULT sched_capacity {fields_text(fields)}")
        return 0
    seed_runs = run_plan(main_plan(workloads, searches, args), args.workers)
    runs = merge_seeds(seed_runs)  # one per variant and rate: the mean over the seeds
    extra: list[Run] = []
    if args.ablation:
        first = judge(make_pairs(runs), workloads[:1])
        extra = run_plan(ablation_plan(workloads[0], first, runs, args), args.workers)
    judgments = judge(make_pairs(runs), workloads)
    if args.reference:
        judgments = with_ample_reference(judgments, workloads, args)
    summary = report(args, workloads, runs, seed_runs, extra, judgments)
    print_capacity(capacity, args.capacity_metric)
    summary |= capacity_fields(capacity, args.capacity_metric)
    out |= results_json(seed_runs, runs, extra, judgments, summary)
    write_json(args, out, time.perf_counter() - t0)
    if not args.no_plots:
        _plots(args.out, runs, workloads)
    print(f"wall {time.perf_counter() - t0:.0f} s ({len(seed_runs) + len(extra)} runs)")
    print(result_line(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
