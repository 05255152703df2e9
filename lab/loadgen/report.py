"""`superinfer bench` results: rows, live attainment, server counters, tables and plots.

A row has the keys of a ``superinfer simulate`` row (``lab.metrics.ROW_KEYS``, the SLO part
from ``lab.metrics.summarize`` over the client's timelines) and then ``vllm bench serve``'s
names (``completed``, ``request_throughput``, ``mean_ttft_ms`` ... ``p99_e2el_ms``), the
client's own lag, and ``slo_class`` (None in the run's row, the class in a per-class row).

Definitions beyond lab.metrics: a request's timeline starts when it was sent and has one
entry per output event (SSE chunk with text or a finish reason); TBT gaps are the gaps between
events (vLLM's ITL). ``output_tokens_per_s`` and the vLLM throughputs count the server's usage
tokens (events when it reports none). vLLM's TPOT is (last event - first event) / (tokens - 1).
``request_goodput`` follows ``--goodput ttft:MS tpot:MS e2el:MS`` (None without it).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from lab.loadgen.core import RequestRecord, RunResult
from lab.metrics import (
    RequestTimeline,
    latency_stats_ms,
    meets_ttft,
    percentile,
    slo_fields,
    summarize,
    tbt_gaps_s,
)

Slos = dict[str | None, tuple[float, float]]  # class (None: no class) -> (TTFT s, TBT s)
GOODPUT_KEYS = ("ttft", "tpot", "e2el")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_SERVER_PREFIXES = ("superinfer:", "vllm:")


@dataclass(frozen=True, slots=True)
class RowContext:
    """What a row needs besides the records."""

    slos: Slos
    duration_s: float
    rps: float | None
    policy: str
    goodput_ms: dict[str, float] | None = None  # --goodput: ttft/tpot/e2el thresholds in ms
    server: dict[str, Any] | None = None  # counter deltas from /metrics
    # vLLM's --metric-percentiles of its --percentile-metrics (p99 of every metric always)
    percentiles: tuple[float, ...] = ()
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")

    def of(self, metric: str) -> tuple[float, ...]:
        """The percentiles reported of ``metric``."""
        return self.percentiles if metric in self.percentile_metrics else ()


def parse_goodput(items: Sequence[str] | None) -> dict[str, float] | None:
    """vLLM's ``--goodput ttft:500 tpot:50`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    if not items:
        return None
    out: dict[str, float] = {}
    for item in items:
        key, _, value = item.partition(":")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--goodput items look like ttft:MS, got {item!r}") from None
        if key not in GOODPUT_KEYS or not number > 0:
            raise ValueError(f"--goodput takes {', '.join(GOODPUT_KEYS)} with MS > 0, got {item!r}")
        out[key] = number
    return out


def timeline(record: RequestRecord, slos: Slos) -> RequestTimeline:
    slo_ttft_s, slo_tbt_s = slos[record.slo_class]
    return RequestTimeline(
        record.sent_s, record.event_times_s, slo_ttft_s, slo_tbt_s, finished=record.ok
    )


def _tpot_s(record: RequestRecord) -> float | None:
    times, num_tokens = record.event_times_s, record.num_output_tokens
    if len(times) < 1 or num_tokens < 2:
        return None
    return (times[-1] - times[0]) / (num_tokens - 1)


def _is_good(record: RequestRecord, goodput_ms: dict[str, float]) -> bool:
    if not record.ok or not record.event_times_s:
        return False
    tpot = _tpot_s(record)
    values_ms = {
        "ttft": 1000 * (record.event_times_s[0] - record.sent_s),
        "tpot": 0.0 if tpot is None else 1000 * tpot,
        "e2el": 1000 * (record.end_s - record.sent_s),
    }
    return all(values_ms[key] <= limit for key, limit in goodput_ms.items())


def vllm_fields(records: Sequence[RequestRecord], ctx: RowContext) -> dict[str, Any]:
    """``vllm bench serve``'s result names over the completed requests."""
    done = [r for r in records if r.ok]
    duration = ctx.duration_s
    num_in = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in done)
    num_out = sum(r.num_output_tokens for r in done)
    tpots = [t for t in (_tpot_s(r) for r in done) if t is not None]
    itls = [g for r in done for g in np.diff(r.event_times_s).tolist()]
    good = None
    if ctx.goodput_ms is not None:
        num_good = sum(_is_good(r, ctx.goodput_ms) for r in done)
        good = num_good / duration if duration > 0 else 0.0
    return {
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "request_goodput": good,
        "output_throughput": num_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (num_in + num_out) / duration if duration > 0 else 0.0,
        **latency_stats_ms(
            "ttft", [r.event_times_s[0] - r.sent_s for r in done if r.event_times_s], ctx.of("ttft")
        ),
        **latency_stats_ms("tpot", tpots, ctx.of("tpot")),
        **latency_stats_ms("itl", itls, ctx.of("itl")),
        **latency_stats_ms("e2el", [r.end_s - r.sent_s for r in done], ctx.of("e2el")),
    }


def bench_row(
    records: Sequence[RequestRecord], ctx: RowContext, slo_class: str | None = None
) -> dict[str, Any]:
    """One result row (module docstring) of ``records``."""
    summary = summarize([timeline(r, ctx.slos) for r in records], duration_s=ctx.duration_s)
    server = ctx.server or {}
    row: dict[str, Any] = {
        "policy": ctx.policy,
        "rps": ctx.rps,
        "num_requests": len(records),
        **slo_fields(summary),
        "preemptions": server.get("preemptions"),
        "rotations": server.get("rotations"),
        "bytes_h2d": server.get("bytes_h2d"),
        "bytes_d2h": server.get("bytes_d2h"),
        "exposed_transfer_s": None,  # not observable from outside the server
    }
    vllm = vllm_fields(records, ctx)
    row["output_tokens_per_s"] = vllm["output_throughput"]
    row.update(vllm)
    row["num_input_len_mismatch"] = sum(
        1 for r in records if r.prompt_tokens is not None and r.prompt_tokens != r.input_len
    )
    row["slo_class"] = slo_class
    return row


def bench_rows(run: RunResult, ctx: RowContext, client_lag: dict[str, float | None]) -> list[dict]:
    """The run's row, then one row per SLO class (when requests carry classes)."""
    rows = [{**bench_row(run.records, ctx), **client_lag}]
    classes = sorted({r.slo_class for r in run.records if r.slo_class is not None})
    for name in classes:
        subset = [r for r in run.records if r.slo_class == name]
        rps = None if ctx.rps is None else ctx.rps * len(subset) / len(run.records)
        class_ctx = replace(ctx, rps=rps, server=None)
        rows.append({**bench_row(subset, class_ctx, name), **client_lag})
    return rows


def client_lag_fields(run: RunResult) -> dict[str, float | None]:
    """How late the client dispatched requests, and its event loop's lag (ms)."""
    dispatch = [max(0.0, r.dispatched_s - r.scheduled_s) for r in run.records]

    def ms(value: float | None) -> float | None:
        return None if value is None else 1000 * value

    return {
        "client_dispatch_lag_mean_ms": ms(float(np.mean(dispatch)) if dispatch else None),
        "client_dispatch_lag_p99_ms": ms(percentile(dispatch, 99)),
        "client_dispatch_lag_max_ms": ms(max(dispatch, default=None)),
        "client_loop_lag_p99_ms": ms(percentile(run.loop_lag_s, 99)),
        "client_loop_lag_max_ms": ms(max(run.loop_lag_s, default=None)),
    }


class LiveStats:
    """Running counts for the progress bar: done, failed, TTFT and TBT attainment so far."""

    def __init__(self, slos: Slos) -> None:
        self.slos = slos
        self.num_done = self.num_failed = self.num_ttft_met = 0
        self.num_gaps = self.num_gaps_met = 0

    def add(self, record: RequestRecord) -> None:
        line = timeline(record, self.slos)
        self.num_done += 1
        self.num_failed += not record.ok
        self.num_ttft_met += meets_ttft(line)
        gaps = tbt_gaps_s(line)
        self.num_gaps += len(gaps)
        self.num_gaps_met += sum(1 for g in gaps if g <= line.slo_tbt_s)

    def describe(self) -> str:
        ttft = 100 * self.num_ttft_met / self.num_done if self.num_done else 100.0
        tbt = 100 * self.num_gaps_met / self.num_gaps if self.num_gaps else 100.0
        return f"failed {self.num_failed}  TTFT {ttft:5.1f}%  TBT {tbt:5.1f}%"


# ---- the server's own counters ---------------------------------------------------------


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        samples.append((name, dict(_LABEL.findall(labels or "")), number))
    return samples


def server_counters(text: str) -> dict[str, Any]:
    """Counters a row reports (summed over workers), the policy, and request/token totals."""
    totals: dict[str, float] = {}
    policy = None
    samples = parse_prometheus(text)
    # Ours when there (a SuperInfer gateway exports vLLM's names too: counting both would
    # double every total), else vLLM's (a vLLM server under test).
    ours = any(name.startswith(_SERVER_PREFIXES[0]) for name, _, _ in samples)
    prefixes = _SERVER_PREFIXES[:1] if ours else _SERVER_PREFIXES[1:]
    for name, labels, value in samples:
        short = next((name[len(p) :] for p in prefixes if name.startswith(p)), None)
        if short is None:
            continue
        if short == "policy_info" and value == 1.0:
            policy = labels.get("policy")
        key = short
        if short == "kv_transfer_bytes_total":
            key = f"bytes_{labels.get('direction', '')}"
        totals[key] = totals.get(key, 0.0) + value
    return {
        "policy": policy,
        "preemptions": totals.get("num_preemptions_total"),
        "rotations": totals.get("num_rotations_out_total"),
        "bytes_h2d": totals.get("bytes_h2d"),
        "bytes_d2h": totals.get("bytes_d2h"),
        "requests": totals.get("request_success_total"),
        "generation_tokens": totals.get("generation_tokens_total"),
        "prompt_tokens": totals.get("prompt_tokens_total"),
    }


def counter_deltas(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """after - before of every numeric counter present in both (None where absent)."""
    if before is None or after is None:
        return {}
    out: dict[str, Any] = {"policy": after.get("policy")}
    for key, value in after.items():
        if key == "policy":
            continue
        old = before.get(key)
        out[key] = None if value is None else round(value - (old or 0.0))
    return out


# ---- tables and plots ------------------------------------------------------------------


def attainment_windows(
    timelines: Sequence[RequestTimeline], duration_s: float, num_windows: int = 10
) -> list[tuple[float, float | None, float | None]]:
    """(window middle s, TTFT attainment of requests sent in it, TBT attainment of gaps ending
    in it) for ``num_windows`` equal windows of the run; None for an empty window."""
    width = max(duration_s, 1e-9) / num_windows
    out = []
    for i in range(num_windows):
        lo, hi = i * width, (i + 1) * width
        last = i == num_windows - 1
        sent = [t for t in timelines if lo <= t.arrival_s < hi or (last and t.arrival_s >= hi)]
        ttft = [
            bool(t.token_times_s) and t.token_times_s[0] - t.arrival_s <= t.slo_ttft_s for t in sent
        ]
        gaps = [
            g <= t.slo_tbt_s
            for t in timelines
            for end, g in zip(t.token_times_s[1:], tbt_gaps_s(t), strict=True)
            if lo <= end < hi or (last and end >= hi)
        ]
        out.append(
            (
                (lo + hi) / 2,
                sum(ttft) / len(ttft) if ttft else None,
                sum(gaps) / len(gaps) if gaps else None,
            )
        )
    return out


def plot_bench(run: RunResult, slos: Slos, path: str | Path, title: str = "") -> None:
    """TTFT and TBT CDFs per class with the SLO lines, and attainment over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tbt, ax_time) = plt.subplots(1, 3, figsize=(15, 4))
    classes = sorted({r.slo_class for r in run.records}, key=lambda c: c or "")
    for name in classes:
        lines = [timeline(r, slos) for r in run.records if r.slo_class == name]
        label = name or "all"
        ttfts = sorted(t.token_times_s[0] - t.arrival_s for t in lines if t.token_times_s)
        gaps = sorted(g for t in lines for g in tbt_gaps_s(t))
        for ax, values, slo in ((ax_ttft, ttfts, slos[name][0]), (ax_tbt, gaps, slos[name][1])):
            if values:
                cdf = np.arange(1, len(values) + 1) / len(values)
                (curve,) = ax.step(values, cdf, where="post", label=label)
                ax.axvline(slo, color=curve.get_color(), linestyle="--", alpha=0.7)
    for ax, heading in ((ax_ttft, "TTFT (s)"), (ax_tbt, "TBT gap (s)")):
        ax.set_xlabel(heading)
        ax.set_ylabel("fraction of requests" if ax is ax_ttft else "fraction of gaps")
        ax.set_title(f"{heading.split()[0]} CDF (dashed: SLO)")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    windows = attainment_windows([timeline(r, slos) for r in run.records], run.duration_s)
    for label, shares in (("TTFT", [w[1] for w in windows]), ("TBT", [w[2] for w in windows])):
        points = [(w[0], 100 * v) for w, v in zip(windows, shares, strict=True) if v is not None]
        ax_time.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax_time.set(xlabel="time in run (s)", ylabel="% within SLO", title="attainment over time")
    ax_time.set_ylim(-2, 102)
    ax_time.grid(True, alpha=0.3)
    ax_time.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def json_text(value: Any) -> str:
    """``value`` as strict JSON: an infinite or NaN float is written as the string "inf",
    "-inf" or "nan" (as vLLM's saved results write an infinite rate; JSON has no such number)."""
    return json.dumps(_json_safe(value), indent=2, allow_nan=False) + "\n"


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value
