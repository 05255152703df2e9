"""bench/classes.py: the mixed-class trace it builds and a short end-to-end run (its shape, not
its figures: those are in docs/benchmarks.md)."""

from __future__ import annotations

import re

import pytest

from bench import classes as cb
from bench.sched_compare import kit_workloads


def _sharegpt() -> cb.Workload:
    workload = {w.name: w for w in kit_workloads(cb.TRACES_DIR)}["sharegpt"]
    if not workload.path.is_file():
        pytest.skip("the kit's ShareGPT trace is not here")
    return workload


def test_mixed_trace_classes() -> None:
    trace = cb.mixed_trace(_sharegpt(), 20.0, 100.0, seed=3)
    fast = [r for r in trace if r.tenant == cb.INTERACTIVE]
    assert len(fast) / len(trace) == pytest.approx(cb.INTERACTIVE_SHARE, abs=0.05)
    assert {r.slo_ttft_s for r in fast} == {cb.INTERACTIVE_TTFT_S}
    assert {r.slo_ttft_s for r in trace if r not in fast} == {cb.BATCH_TTFT_S}
    again = cb.mixed_trace(_sharegpt(), 20.0, 100.0, seed=3)
    assert [(r.arrival_s, r.tenant) for r in again] == [(r.arrival_s, r.tenant) for r in trace]


def test_the_bench_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    _sharegpt()
    argv = ["--traces", "sharegpt", "--seeds", "1", "--duration", "4", "--workers", "1"]
    assert cb.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.match(
        r"^RESULT classes interactive_delta_pts=\S+ interactive_delta_pts_lo=\S+ "
        r"interactive_delta_pts_hi=\S+ interactive_delta_pts_vlt=\S+ batch_goodput_ratio=\S+ "
        r".*goodput_ratio=\S+ .*"
        r"batch_goodput_ratio_late=\S+ .*demoted_share_late=\S+$",
        lines[-1],
    )
    assert sum(line.startswith(("PASS sharegpt", "FAIL sharegpt")) for line in lines) == 2


def test_unknown_traces_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cb.main(["--traces", "nope"]) == 2
    assert "unknown traces ['nope']" in capsys.readouterr().err
