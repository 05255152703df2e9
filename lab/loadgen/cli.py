"""`superinfer bench` command: flags, server discovery, the run under a progress bar, outputs.

Wire-up (superinfer/cli.py)::

    bench = sub.add_parser("bench", help="SLO load generator for an OpenAI-compatible server")
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench_command)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from lab.loadgen.capacity import (
    add_capacity_arguments,
    check_capacity_arguments,
    report_capacity,
    search_capacity,
)
from lab.loadgen.console import parse_percentiles, print_percentiles, print_rows
from lab.loadgen.core import (
    ENDPOINT_PATHS,
    ClientSettings,
    PlannedRequest,
    RequestRecord,
    RunResult,
    ServerInfo,
    fetch_server_info,
    normalize_base_url,
    run_requests,
)
from lab.loadgen.prompts import PromptBuilder, load_bench_tokenizer, plan_requests
from lab.loadgen.report import (
    LiveStats,
    RowContext,
    Slos,
    bench_rows,
    client_lag_fields,
    counter_deltas,
    json_text,
    parse_goodput,
    plot_bench,
    server_counters,
)
from lab.optional import check_plot
from lab.traces import TraceRequest, load_trace
from shared.slo import DEFAULT_SLO_CLASSES

DEFAULT_SLO_CLASS = "standard"  # what the gateway judges a request without a class by
NUM_PROMPTS_CHECKED = 3  # prompts whose length is verified with a full encode
COUNTER_SETTLE_S = 1.0  # worker counters reach /metrics with its heartbeat (0.5 s)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (leave it out for no limit), got {value}")
    return value


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    add("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions")
    add("--model", default=None, help="model name to send (default: the first of /v1/models)")
    add("--tokenizer", default=None, help="model dir/file, tokenizer.json or tok*.bin")
    add("--trace", required=True, help="trace file (Azure/Mooncake/length-stats) or synthetic")
    add(
        "--rps",
        "--request-rate",  # vLLM's name
        dest="rps",
        type=float,
        default=None,
        help="request rate (real traces: rescaled to it)",
    )
    add("--burstiness", type=float, default=1.0, help="gamma shape of generated gaps (1=Poisson)")
    span = parser.add_mutually_exclusive_group()
    span.add_argument("--duration", type=float, default=None, help="seconds of arrivals")
    span.add_argument(
        "--num-requests",
        "--num-prompts",  # vLLM's name
        dest="num_requests",
        type=_at_least_one,
        default=None,
        help="first N requests",
    )
    add("--max-input-len", type=int, default=None, help="clip prompts to this many tokens")
    add("--max-output-len", type=int, default=None, help="clip outputs to this many tokens")
    add("--max-concurrency", type=_at_least_one, default=None, help="requests in flight at most")
    classes = parser.add_mutually_exclusive_group()
    classes.add_argument("--slo-class", default=None, help="x-slo-class of every request")
    classes.add_argument("--class-mix", default=None, help="e.g. interactive=0.2,standard=0.8")
    add("--ttft-slo", type=float, default=None, help="judge TTFT against this (s), all classes")
    add("--tbt-slo", type=float, default=None, help="judge TBT against this (s), all classes")
    add("--goodput", nargs="+", default=None, help="vLLM's goodput SLOs: ttft:MS tpot:MS e2el:MS")
    add(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="vLLM's: the metrics whose --metric-percentiles are reported (ttft,tpot,itl,e2el)",
    )
    add("--metric-percentiles", default="99", help="vLLM's: percentiles reported, e.g. 50,90,99")
    add("--seed", type=int, default=0)
    add("--api-key", default=None)
    add(
        "--admin-token",
        default=os.environ.get("SUPERINFER_ADMIN_TOKEN"),
        help="read the server's SLO classes (default: $SUPERINFER_ADMIN_TOKEN)",
    )
    add("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    add(
        "--timeout",
        type=_positive_float,
        default=600.0,
        help="seconds one request may take, in all",
    )
    add("--no-progress", action="store_true", help="no progress bar")
    add("--json", default=None, help="write {config, results, requests} here")
    add("--plot", default=None, help="PNG: TTFT/TBT CDFs with SLO lines, attainment over time")
    add_capacity_arguments(parser)


def parse_class_mix(args: argparse.Namespace) -> list[tuple[str, float]]:
    if args.slo_class:
        return [(args.slo_class, 1.0)]
    if not args.class_mix:
        return []
    mix = []
    for item in args.class_mix.split(","):
        name, _, weight = item.strip().partition("=")
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"--class-mix items look like NAME=WEIGHT, got {item!r}") from None
        if not name or not value > 0:
            raise ValueError(f"--class-mix needs a name and a weight > 0, got {item!r}")
        mix.append((name, value))
    return mix


def resolve_slos(
    names: list[str | None], server_classes: dict[str, tuple[float, float]], args: Any
) -> Slos:
    """Each class's (TTFT, TBT) SLOs: the server's (or the defaults), --ttft-slo/--tbt-slo
    winning; no class: the default class's."""
    slos: Slos = {}
    for name in names:
        known = server_classes.get(name or DEFAULT_SLO_CLASS)
        if known is None and (args.ttft_slo is None or args.tbt_slo is None):
            raise ValueError(
                f"unknown SLO class {name!r} (known: {sorted(server_classes)}); "
                "give --ttft-slo and --tbt-slo to judge it"
            )
        ttft_s = args.ttft_slo if args.ttft_slo is not None else known[0]  # type: ignore[index]
        tbt_s = args.tbt_slo if args.tbt_slo is not None else known[1]  # type: ignore[index]
        if not (ttft_s > 0 and tbt_s > 0):
            raise ValueError("--ttft-slo and --tbt-slo must be > 0")
        slos[name] = (ttft_s, tbt_s)
    return slos


async def _get_json(url: str, token: str | None) -> Any | None:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            response = await client.get(url, headers=headers)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _server_classes(root: str, admin_token: str | None) -> dict[str, tuple[float, float]]:
    classes = {c.name: (c.ttft_s, c.tbt_s) for c in DEFAULT_SLO_CLASSES.values()}
    if admin_token:
        body = await _get_json(f"{root}/admin/v1/slo-classes", admin_token)
        if isinstance(body, dict) and isinstance(body.get("classes"), dict):
            classes = {n: (c["ttft_s"], c["tbt_s"]) for n, c in body["classes"].items()}
    return classes


async def _scrape(root: str) -> dict[str, Any] | None:
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            response = await client.get(f"{root}/metrics")
    except httpx.HTTPError:
        return None
    return server_counters(response.text) if response.status_code == 200 else None


def _trace(args: argparse.Namespace) -> list[TraceRequest]:
    return load_trace(
        args.trace,
        rps=args.rps,
        duration_s=args.duration,
        num_requests=args.num_requests,
        burstiness=args.burstiness,
        seed=args.seed,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
    )


def _offered_rps(args: argparse.Namespace, planned: list[PlannedRequest]) -> float | None:
    if args.rps is not None:
        return float(args.rps)
    if len(planned) > 1 and planned[-1].arrival_s > planned[0].arrival_s:
        return (len(planned) - 1) / (planned[-1].arrival_s - planned[0].arrival_s)
    return None


async def _discover(args: argparse.Namespace) -> ServerInfo:
    try:
        server = await fetch_server_info(args.base_url, args.api_key)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        if args.model is None:
            raise ValueError(f"cannot read {args.base_url}/v1/models: {exc}") from exc
        return ServerInfo(args.model)
    return ServerInfo(args.model or server.model, server.max_model_len, server.root)


def _run_with_progress(
    settings: ClientSettings, planned: list[PlannedRequest], slos: Slos, show: bool
) -> RunResult:
    live = LiveStats(slos)
    if not show:
        return asyncio.run(run_requests(settings, planned, live.add))
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, "{task.fields[live]}", transient=False) as progress:
        task = progress.add_task("requests", total=len(planned), live=live.describe())

        def on_done(record: RequestRecord) -> None:
            live.add(record)
            progress.update(task, advance=1, live=live.describe())

        return asyncio.run(run_requests(settings, planned, on_done))


@dataclass(frozen=True, slots=True)
class BenchOutcome:
    document: dict[str, Any]  # {"config", "results", "requests"}, as --json writes it
    run: RunResult
    slos: Slos


def run_bench(args: argparse.Namespace) -> BenchOutcome:
    """Discover, plan, run, report."""
    goodput_ms = parse_goodput(args.goodput)
    percentiles = parse_percentiles(args.metric_percentiles, args.percentile_metrics)
    mix = parse_class_mix(args)
    root = normalize_base_url(args.base_url)
    server = asyncio.run(_discover(args))
    server_classes = asyncio.run(_server_classes(root, args.admin_token))
    slos = resolve_slos([n for n, _ in mix] or [None], server_classes, args)
    builder = PromptBuilder(load_bench_tokenizer(server, args.tokenizer))
    planned, num_clipped = plan_requests(
        _trace(args), builder, mix, server.max_model_len, args.seed
    )
    checked = planned[:NUM_PROMPTS_CHECKED]
    num_mismatched = sum(builder.count(p.prompt) != p.input_len for p in checked)
    settings = ClientSettings(
        root, server.model, args.endpoint, args.api_key, not args.no_ignore_eos,
        args.max_concurrency, args.timeout,
    )  # fmt: skip
    before = asyncio.run(_scrape(root))
    run = _run_with_progress(settings, planned, slos, not args.no_progress)
    if before is not None:
        asyncio.run(asyncio.sleep(COUNTER_SETTLE_S))
    server_delta = counter_deltas(before, asyncio.run(_scrape(root)))
    ctx = RowContext(
        slos, run.duration_s, _offered_rps(args, planned),
        server_delta.get("policy") or "unknown", goodput_ms, server=server_delta,
        percentiles=percentiles[0], percentile_metrics=percentiles[1],
    )  # fmt: skip
    config = {key: value for key, value in vars(args).items() if key not in ("func", "api_key")} | {
        "model": server.model,
        "max_model_len": server.max_model_len,
        "num_clipped": num_clipped,
        "prompt_lengths_checked": len(checked),
        "prompt_lengths_mismatched": num_mismatched,
        "slos": {name or DEFAULT_SLO_CLASS: list(v) for name, v in slos.items()},
        "server_counters": server_delta,
    }
    config.pop("admin_token", None)
    rows = bench_rows(run, ctx, client_lag_fields(run))
    requests = [_request_json(r) for r in run.records]
    return BenchOutcome({"config": config, "results": rows, "requests": requests}, run, slos)


def _request_json(record: RequestRecord) -> dict[str, Any]:
    times = record.event_times_s
    return {
        "index": record.index,
        "slo_class": record.slo_class,
        "scheduled_s": record.scheduled_s,
        "sent_s": record.sent_s,
        "ttft_s": times[0] - record.sent_s if times else None,
        "e2el_s": record.end_s - record.sent_s,
        "num_events": len(times),
        "itl_s": [later - earlier for earlier, later in itertools.pairwise(times)],
        "input_len": record.input_len,
        "output_len": record.output_len,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "finish_reason": record.finish_reason,
        "error": record.error,
    }


def run_bench_command(args: argparse.Namespace) -> int:
    try:
        check_plot(args.plot)
        check_capacity_arguments(args)
        if args.capacity:
            return _run_capacity(args)
        outcome = run_bench(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    document = outcome.document
    rows = document["results"]
    overall = rows[0]
    print_rows(rows, title=f"{document['config']['model']} @ {args.base_url} ({overall['policy']})")
    print_percentiles(overall, *parse_percentiles(args.metric_percentiles, args.percentile_metrics))
    print(
        f"client lag: dispatch p99 {overall['client_dispatch_lag_p99_ms'] or 0.0:.2f} ms, "
        f"event loop p99 {overall['client_loop_lag_p99_ms'] or 0.0:.2f} ms"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json_text(document), encoding="utf-8")
    if args.plot:
        title = f"{document['config']['model']}, policy {overall['policy']}"
        plot_bench(outcome.run, outcome.slos, args.plot, title=title)
    return 0 if overall["completed"] > 0 else 1


def _run_capacity(args: argparse.Namespace) -> int:
    """``--capacity``: whole runs at the rates the search picks (lab/loadgen/capacity.py)."""
    model: list[str] = []

    def run_at(rate: float) -> dict[str, Any]:
        probe = argparse.Namespace(**{**vars(args), "rps": rate, "no_progress": True, "json": None})
        document = run_bench(probe).document
        model[:] = [document["config"]["model"]]
        row: dict[str, Any] = document["results"][0]
        return row

    result = search_capacity(args, run_at)
    report_capacity(args, result, model[0] if model else str(args.model))
    return 0 if result.rows and any(row["completed"] for row in result.rows) else 1


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
