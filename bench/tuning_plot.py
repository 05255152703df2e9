"""The figure of bench/tuning_curves.py: TTFT and TBT attainment against each knob (matplotlib,
Agg backend)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shared.policy import Knobs

ROWS = (("ttft_attainment", "TTFT attainment %"), ("tbt_attainment", "TBT attainment %"))
LOG_X = frozenset({"b_xfer"})


def _reference(rows: Sequence[dict[str, Any]], trace: str, knob: str, key: str) -> float:
    (row,) = [r for r in rows if r["trace"] == trace and r["knob"] == knob]
    return 100.0 * float(row[key])


def _panel(ax: Any, rows: Sequence[dict[str, Any]], knob: str, key: str, traces: list[str]) -> None:
    for index, trace in enumerate(traces):
        color = f"C{index}"
        points = sorted(
            (float(r["value"]), 100.0 * float(r[key]))
            for r in rows
            if r["trace"] == trace and r["knob"] == knob
        )
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=color, label=trace)
        ax.axhline(_reference(rows, trace, "vllm", key), color=color, ls="--", lw=1)
        ax.axhline(_reference(rows, trace, "default", key), color=color, ls=":", lw=1.2)
    if knob in LOG_X:
        ax.set_xscale("log")
    ax.grid(True, alpha=0.3)


def plot_curves(
    rows: Sequence[dict[str, Any]],
    path: str | Path,
    sweeps: Mapping[str, Sequence[float]],
    defaults: Knobs,
) -> None:
    """One column per knob; lines per trace; dashed: vllm, dotted: lvf at every default
    (b_xfer auto, adaptive residency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(str(r["trace"]) for r in rows))
    knobs = list(sweeps)
    fig, axes = plt.subplots(len(ROWS), len(knobs), figsize=(3.2 * len(knobs), 6.2), sharey="row")
    for col, knob in enumerate(knobs):
        for row_index, (key, heading) in enumerate(ROWS):
            ax = axes[row_index][col]
            _panel(ax, rows, knob, key, traces)
            if col == 0:
                ax.set_ylabel(heading)
        default = getattr(defaults, knob, None)
        shown = "auto" if knob == "b_xfer" else "adaptive" if knob == "min_residency_s" else default
        axes[0][col].set_title(f"{knob} (default {shown})")
        axes[-1][col].set_xlabel(knob + (" (fixed)" if knob == "min_residency_s" else ""))
    axes[0][0].legend(loc="lower left", fontsize=8)
    fig.suptitle(
        "LVF, one knob moved (h200-llama3-8b, contended rate); dashed: vllm, dotted: lvf defaults"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
