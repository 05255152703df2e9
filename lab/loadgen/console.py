"""What ``superinfer bench`` prints: the result rows as a table, and vLLM's
``--metric-percentiles`` of its ``--percentile-metrics`` (the results carry them as
``p<P>_<metric>_ms``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lab.metrics import percentile_key

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_percentiles(percentiles: str, metrics: str) -> tuple[tuple[float, ...], tuple[str, ...]]:
    """vLLM's ``--metric-percentiles 50,90,99`` and ``--percentile-metrics ttft,tpot,itl``;
    ValueError naming the flag for anything else."""
    try:
        values = tuple(float(item) for item in percentiles.split(","))
    except ValueError:
        message = f"--metric-percentiles takes numbers like 50,90,99, not {percentiles!r}"
        raise ValueError(message) from None
    if not all(0.0 < value <= 100.0 for value in values):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {percentiles!r}")
    names = tuple(item.strip() for item in metrics.split(","))
    unknown = [name for name in names if name not in PERCENTILE_METRICS]
    if unknown:
        known = ",".join(PERCENTILE_METRICS)
        raise ValueError(f"--percentile-metrics takes {known}; {unknown[0]!r} is none of them")
    return values, names


def print_percentiles(
    row: dict[str, Any], percentiles: tuple[float, ...], metrics: tuple[str, ...]
) -> None:
    """vLLM's percentile lines for each of ``metrics`` (the table shows p99 of each)."""
    for metric in metrics:
        values = ", ".join(
            f"{percentile_key(p)} {_ms_text(row.get(f'{percentile_key(p)}_{metric}_ms'))}"
            for p in percentiles
        )
        print(f"{metric.upper()} ms: mean {_ms_text(row.get(f'mean_{metric}_ms'))}, {values}")


def _ms_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_rows(rows: Sequence[dict[str, Any]], title: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    headings = ["class", "done", "failed", "req/s", "out tok/s", "TTFT %", "TBT %", "TPOT %"]
    headings += ["goodput", "TTFT mean/p50/p99 ms", "TPOT mean/p99 ms", "ITL p99 ms", "E2EL p99 ms"]
    for heading in headings:
        table.add_column(heading, justify="right")
    for r in rows:
        table.add_row(
            r["slo_class"] or "all",
            str(r["completed"]),
            str(r["failed"]),
            f"{r['request_throughput']:.2f}",
            f"{r['output_throughput']:.1f}",
            f"{100 * r['ttft_attainment']:.1f}",
            f"{100 * r['tbt_attainment']:.1f}",
            f"{100 * r['tpot_attainment']:.1f}",
            _goodput(r),
            "/".join(_ms(r[f"{s}_ttft_ms"]) for s in ("mean", "median", "p99")),
            "/".join(_ms(r[f"{s}_tpot_ms"]) for s in ("mean", "p99")),
            _ms(r["p99_itl_ms"]),
            _ms(r["p99_e2el_ms"]),
        )
    Console(width=max(150, Console().width)).print(table)


def _goodput(row: dict[str, Any]) -> str:
    """Requests/s within the SLOs: ``--goodput``'s (vLLM's) when given, else the classes'."""
    good = row.get("request_goodput")
    return f"{row['goodput_rps']:.2f}" if good is None else f"{good:.2f} (--goodput)"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"
