"""Attainment-vs-rate plots of simulation rows (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

PANELS = (("ttft_attainment", "TTFT SLO attainment"), ("tbt_attainment", "TBT SLO attainment"))


def plot_attainment(
    rows: Sequence[dict[str, Any]],
    path: str | Path,
    title: str = "",
    labels: Sequence[str] | None = None,
) -> None:
    """One panel per metric (TTFT, TBT attainment in %), x = request rate, one line per
    policy (or per ``labels[i]`` when given, one per row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(labels) if labels is not None else [str(r["policy"]) for r in rows]
    if len(names) != len(rows):
        raise ValueError("labels must have one entry per row")
    series: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for name, row in zip(names, rows, strict=True):
        series.setdefault(name, []).append((float(row["rps"]), row))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(11, 4), sharex=True)
    for ax, (key, heading) in zip(axes, PANELS, strict=True):
        for name, points in series.items():
            points.sort(key=lambda p: p[0])
            ax.plot(
                [p[0] for p in points], [100 * p[1][key] for p in points], marker="o", label=name
            )
        ax.set_title(heading)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("% within SLO")
        ax.set_ylim(-2, 102)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
