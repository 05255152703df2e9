"""bench/tuning_curves.py: each sweep point becomes the simulation it names (b_xfer in the setup,
a fixed residency with the controller off), the best value is the goodput maximum, and the
figure and RESULT line come out of rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import tuning_curves as tc
from bench.sched_compare import TRACES, kit_workloads
from bench.tuning_plot import plot_curves


def _workload() -> Any:
    return {w.name: w for w in kit_workloads(TRACES)}["sharegpt"]


def test_points_become_the_runs_they_name() -> None:
    w = _workload()
    residency = tc.job_for(w, tc.Point("sharegpt", "min_residency_s", 2.0), 5.0)
    assert residency.knobs.min_residency_s == 2.0 and not residency.knobs.adaptive_residency
    budget = tc.job_for(w, tc.Point("sharegpt", "b_xfer", 300.0), 5.0)
    assert budget.setup.b_xfer == 300 and budget.knobs == tc.DEFAULTS
    alpha = tc.job_for(w, tc.Point("sharegpt", "alpha", 6.0), 5.0)
    assert alpha.knobs.alpha == 6.0 and alpha.setup.b_xfer == "auto" and alpha.policy == "lvf"
    assert tc.job_for(w, tc.Point("sharegpt", "vllm", None), 5.0).policy == "vllm"
    assert len(tc.plan([w])) == 2 + sum(len(v) for v in tc.SWEEPS.values())


def _rows() -> list[dict[str, Any]]:
    rows = []
    for trace in tc.RATES:
        for knob, values in [("vllm", [None]), ("default", [None]), *tc.SWEEPS.items()]:
            for i, value in enumerate(values):
                good = 1.0 + (i == 1)  # the second value of every sweep wins
                rows.append({
                    "trace": trace, "knob": knob, "value": value, "goodput_rps": good,
                    "ttft_attainment": 0.5, "tbt_attainment": 0.9, "rotations": 3,
                })  # fmt: skip
    return rows


def test_summary_picks_the_goodput_maximum(tmp_path: Path) -> None:
    summary = tc.summarize(_rows(), 1.0)
    assert summary["sharegpt_alpha_best"] == tc.SWEEPS["alpha"][1]
    assert summary["azure-code_b_xfer_best"] == tc.SWEEPS["b_xfer"][1]
    assert summary["sharegpt_vllm_ttft"] == 0.5
    assert tc.result_line(summary).startswith("RESULT tuning_curves wall_s=1.0 runs=")
    plot_curves(_rows(), tmp_path / "curves.png", tc.SWEEPS, tc.DEFAULTS)
    assert (tmp_path / "curves.png").stat().st_size > 10_000
