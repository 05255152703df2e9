"""``superinfer simulate``: policies x request rates over a trace, in virtual time.

Wire-up (superinfer/cli.py)::

    sim = sub.add_parser("simulate", help="compare policies on a trace in virtual time")
    add_simulate_arguments(sim)
    sim.set_defaults(func=run_simulate)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from lab.costmodel import load_profile, with_link_scale
from lab.optional import check_plot
from lab.sim.setup import SimSetup
from lab.sim.simulator import ProgressFn
from lab.sim.sweep import SweepJob, run_sweep
from shared.policy import PAPER_LVF, POLICY_NAMES, Knobs

_DEFAULTS = Knobs()


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--trace", required=True, help="trace file (Azure/Mooncake/length-stats) or synthetic")
    add("--rps", required=True, help="comma-separated request rates, e.g. 2,4,8")
    add("--duration", type=float, default=120.0, help="seconds of arrivals (default 120)")
    add("--policies", default="vllm,lvf", help=f"comma-separated: {', '.join(POLICY_NAMES)}")
    add("--profile", default="h200-llama3-8b", help="cost profile name or JSON path")
    add(
        "--link-scale",
        type=float,
        default=1.0,
        help="what-if: the profile's host link this many times faster (default 1)",
    )
    add("--hbm-kv-gib", type=float, default=16.0, help="HBM KV pool (GiB)")
    add("--dram-kv-gib", type=float, default=128.0, help="host DRAM KV pool (GiB); 0 = none")
    add("--burstiness", type=float, default=1.0, help="gamma shape of generated gaps (1=Poisson)")
    add("--seed", type=int, default=0, help="seed of arrivals (a real trace: its window)")
    add("--seeds", type=int, default=1, help="run every point on seeds seed .. seed+N-1")
    add("--hawkes", type=float, default=0.0, help="Hawkes arrivals: branching ratio (0 = off)")
    add("--hawkes-tau", type=float, default=1.0, help="Hawkes kernel mean delay (s)")
    add(
        "--capacity",
        action="store_true",
        help="search each policy's SLO capacity (highest rate with >= --capacity-target of "
        "requests meeting TTFT and TPOT) from the one --rps given, per seed",
    )
    add("--capacity-target", type=float, default=0.9, help="with --capacity (default 0.9)")
    add("--alpha", type=float, default=_DEFAULTS.alpha)
    add("--beta-b", type=float, default=_DEFAULTS.beta_b)
    add(
        "--min-residency",
        type=float,
        default=_DEFAULTS.min_residency_s,
        help="LVF extension: seconds a (re)started request is spared by the tail scan (0: off); "
        "with adaptive residency, the least the controller may set",
    )
    add(
        "--paper-lvf",
        action="store_true",
        help="LVF exactly as SUPERINFER.md §4 (every extension off, min residency 0)",
    )
    add("--beta-f", type=float, default=_DEFAULTS.beta_f)
    add("--ttft-slo", type=float, default=_DEFAULTS.slo_ttft_s, help="S_F seconds")
    add("--tbt-slo", type=float, default=_DEFAULTS.slo_tbt_s, help="S_B seconds")
    add("--b-xfer", default="auto", help="blocks per iteration, or auto (default)")
    add("--transfer", choices=("duplex", "naive"), default="duplex")
    add("--no-eager-sync", action="store_true", help="ablation: no background D2H sync")
    add(
        "--prefix-caching",
        choices=("off", "hbm", "both"),
        default="off",
        help="prefix caching: off, HBM only (vLLM V1's), or HBM + the DRAM tier (a policy "
        "without DRAM gets HBM); prompts share prefixes only where the trace has hash_ids",
    )
    add("--max-num-batched-tokens", type=int, default=8192)
    add("--max-num-seqs", type=int, default=256)
    add(
        "--horizon",
        type=float,
        default=None,
        help="stop each run at this virtual time (s); unfinished requests count as misses",
    )
    add("--workers", type=int, default=1, help="processes running simulations in parallel")
    add("--json", required=True, help="output JSON path")
    add("--plot", default=None, help="attainment-vs-rate PNG path")


def _parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--rps must be comma-separated numbers, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--rps needs rates > 0, got {text!r}")
    return rates


def _parse_policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if not policies or unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICY_NAMES)}")
    return policies


def _parse_b_xfer(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--b-xfer must be a block count or auto, got {text!r}") from None


def build_jobs(args: argparse.Namespace) -> tuple[list[SweepJob], dict[str, Any]]:
    """The jobs (rates outer, policies inner) and the JSON ``config`` of ``args``."""
    rates, policies = _parse_rates(args.rps), _parse_policies(args.policies)
    knobs = Knobs(
        alpha=args.alpha,
        beta_b=args.beta_b,
        beta_f=args.beta_f,
        min_residency_s=args.min_residency,
        slo_ttft_s=args.ttft_slo,
        slo_tbt_s=args.tbt_slo,
    )
    if args.paper_lvf:
        knobs = dataclasses.replace(knobs, **PAPER_LVF)
    setup = SimSetup(
        with_link_scale(load_profile(args.profile), args.link_scale),
        args.hbm_kv_gib,
        args.dram_kv_gib,
        _parse_b_xfer(args.b_xfer),
        args.max_num_batched_tokens,
        args.max_num_seqs,
        args.transfer,
        not args.no_eager_sync,
        prefix_caching=args.prefix_caching,
    )
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    if args.capacity and len(rates) != 1:
        raise ValueError(f"--capacity searches from one --rps (its start), got {args.rps!r}")
    if not args.capacity and args.capacity_target != 0.9:
        raise ValueError("--capacity-target applies only with --capacity")
    if args.capacity and args.plot:
        raise ValueError("--plot draws attainment against the rates given; not with --capacity")
    if not 0 < args.capacity_target <= 1:
        raise ValueError(f"--capacity-target must be in (0, 1], got {args.capacity_target}")
    jobs = [
        SweepJob(
            args.trace,
            rate,
            args.duration,
            policy,
            knobs,
            setup,
            args.burstiness,
            seed,
            label=policy if args.seeds == 1 else f"{policy} s{seed}",
            horizon_s=args.horizon,
            hawkes=args.hawkes,
            hawkes_tau_s=args.hawkes_tau,
        )
        for rate in rates
        for policy in policies
        for seed in range(args.seed, args.seed + args.seeds)
    ]
    return jobs, _config(args, rates, policies, setup)


def _config(
    args: argparse.Namespace, rates: list[float], policies: list[str], setup: SimSetup
) -> dict[str, Any]:
    """The JSON ``config`` of a run: every setting, plus the pool sizes in blocks."""
    keys = (
        "trace",
        "duration",
        "burstiness",
        "hawkes",
        "hawkes_tau",
        "seed",
        "seeds",
        "capacity",
        "capacity_target",
        "alpha",
        "beta_b",
        "beta_f",
        "min_residency",
        "paper_lvf",
        "ttft_slo",
        "tbt_slo",
        "transfer",
        "max_num_batched_tokens",
        "max_num_seqs",
        "horizon",
        "hbm_kv_gib",
        "dram_kv_gib",
        "link_scale",
    )
    config: dict[str, Any] = {key: getattr(args, key) for key in keys}
    config.update(
        rps=rates,
        policies=policies,
        profile=setup.profile.name,
        num_hbm_blocks=setup.num_hbm_blocks,
        num_dram_blocks=setup.num_dram_blocks,
        block_bytes=setup.block_bytes,
        b_xfer=setup.b_xfer,
        eager_sync=setup.eager_sync,
        prefix_caching=setup.prefix_caching,
    )
    return config


def run_with_progress(jobs: list[SweepJob], workers: int) -> list[tuple[dict, dict]]:
    """run_sweep under a rich progress bar (runs done; requests done of the current run)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        overall = progress.add_task("simulations", total=len(jobs))
        current = progress.add_task("requests", total=1, visible=workers == 1)

        def on_progress(index: int) -> ProgressFn:
            job = jobs[index]
            progress.update(current, description=f"{job.name} @ {job.rps:g} req/s", completed=0)

            def update(done: int, total: int) -> None:
                progress.update(current, completed=done, total=max(1, total))

            return update

        def on_done(index: int, job: SweepJob, row: dict) -> None:
            progress.advance(overall)

        return run_sweep(jobs, workers, on_done, on_progress if workers == 1 else None)


def print_table(
    rows: list[dict[str, Any]], labels: list[str] | None = None, title: str | None = None
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for heading in (
        "policy",
        "rps",
        "TTFT %",
        "TBT %",
        "TPOT %",
        "goodput",
        "tok/s",
        "TTFT p99 s",
        "TBT p99 ms",
        "preempt",
        "rotations",
        "exposed s",
    ):
        table.add_column(heading, justify="right")
    for i, r in enumerate(rows):
        table.add_row(
            labels[i] if labels else r["policy"],
            f"{r['rps']:g}",
            f"{100 * r['ttft_attainment']:.1f}",
            f"{100 * r['tbt_attainment']:.1f}",
            f"{100 * r['tpot_attainment']:.1f}",
            f"{r['goodput_rps']:.2f}",
            f"{r['output_tokens_per_s']:.0f}",
            _fmt(r["ttft_p99_s"], 1.0, "{:.2f}"),
            _fmt(r["tbt_p99_s"], 1000.0, "{:.0f}"),
            str(r["preemptions"]),
            str(r["rotations"]),
            f"{r['exposed_transfer_s']:.2f}",
        )
    Console(width=max(140, Console().width)).print(table)


def _fmt(value: float | None, scale: float, spec: str) -> str:
    return "-" if value is None else spec.format(value * scale)


def run_simulate(args: argparse.Namespace) -> int:
    try:
        check_plot(args.plot)
        jobs, config = build_jobs(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.capacity:
        from lab.sim.capacity import run_capacity_mode

        return run_capacity_mode(jobs, config, args.capacity_target, args.workers, args.json)
    try:
        results = run_with_progress(jobs, args.workers)
    except ValueError as exc:  # e.g. burstiness on a trace with real arrivals
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = [row for row, _ in results]
    out = {"config": config, "results": rows, "details": [d for _, d in results]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print_table(rows, [d["label"] for _, d in results])
    if args.plot:
        from lab.sim.plot import plot_attainment

        plot_attainment(rows, args.plot, title=f"{Path(args.trace).name} on {config['profile']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m lab.sim.cli`` until superinfer/cli.py has the subcommand."""
    parser = argparse.ArgumentParser(prog="superinfer simulate", description=__doc__)
    add_simulate_arguments(parser)
    return run_simulate(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
