"""bench/sched_compare.py: the knee search, the judgments and the RESULT line on made-up rows,
and two short end-to-end runs (a small trace not in the kit, which takes the search path; and
``--quick`` on two of the kit's traces). The runs check the report's shape, not its figures:
the policies under test change."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from bench import sched_compare as sc

RESULT_RE = re.compile(
    r"^RESULT sched_compare worst_goodput_ratio=\S+ worst_tput_ratio=\S+ "
    r"gh200_gain_pts=\S+ h200_gain_pts=\S+ tbt_delta_pts=\S+ "
    r"gh200_memory_gap_pts=\S+ h200_memory_gap_pts=\S+$"
)


def _search(search: sc.KneeSearch, attainment) -> sc.KneeSearch:
    while (rate := search.next_rate()) is not None:
        search.probes.append((rate, attainment(rate)))
    return search


def _falling(knee: float):
    """A monotone TTFT attainment that crosses 50 % at ``knee``."""
    return lambda rps: min(1.0, max(0.0, 1.0 - 0.5 * rps / knee))


@pytest.mark.parametrize("start", [0.3, 6.0, 7.0, 100.0])
def test_knee_search_brackets_then_bisects(start: float) -> None:
    search = _search(sc.KneeSearch(start, sc.SEARCH_TOL), _falling(7.0))
    lo, hi = search.bracket()
    assert lo is not None and hi is not None
    assert lo[0] <= 7.0 <= hi[0] and hi[0] / lo[0] <= sc.SEARCH_TOL + 1e-9
    assert search.knee() == pytest.approx(7.0, rel=1e-6)  # linear inside the bracket
    assert len(search.probes) <= sc.MAX_PROBES


def test_knee_search_from_the_table_takes_two_probes_when_it_holds() -> None:
    search = _search(sc.KneeSearch(7.2, sc.SEARCH_TOL, sc.SEARCH_TOL), _falling(7.0))
    assert len(search.probes) == 2
    table = sc.KneeSearch(7.2, sc.SEARCH_TOL, table_knee=7.2)
    assert table.next_rate() is None and table.knee() == 7.2


def test_knee_search_gives_up_without_a_crossing() -> None:
    never = _search(sc.KneeSearch(1.0, sc.SEARCH_TOL), lambda rps: 1.0)
    assert len(never.probes) <= sc.MAX_PROBES
    assert never.knee() == max(r for r, _ in never.probes) == sc.MAX_SEARCH_RPS
    always = _search(sc.KneeSearch(1.0, sc.SEARCH_TOL), lambda rps: 0.0)
    assert len(always.probes) <= sc.MAX_PROBES and always.knee() <= sc.MIN_SEARCH_RPS


def test_sweep_rates() -> None:
    rates = sc.sweep_rates(8.86, quick=False)
    assert [f for f, _ in rates] == list(sc.RATE_FACTORS)
    assert [r for _, r in rates] == [2.2, 4.4, 6.6, 8.9, 11.0, 13.0, 18.0]
    assert [r for _, r in sc.sweep_rates(8.86, quick=True)] == [4.4, 18.0]


def _row(ttft: float, tbt: float = 0.95, goodput: float = 1.0, tput: float = 1000.0) -> dict:
    return {
        "ttft_attainment": ttft,
        "tbt_attainment": tbt,
        "goodput_rps": goodput,
        "output_tokens_per_s": tput,
    }


def _cell(trace: str, profile: str, lvf_at_contended: dict) -> list[sc.Pair]:
    return [
        sc.Pair(trace, profile, 0.5, 4.0, _row(1.0), _row(1.0)),
        sc.Pair(trace, profile, 1.5, 12.0, _row(0.3), lvf_at_contended),
        sc.Pair(trace, profile, 2.0, 16.0, _row(0.2), _row(0.3, tbt=0.7)),
    ]


def test_judgments_and_result_line() -> None:
    workloads = [
        sc.Workload("sharegpt", Path("a"), 16.0),
        sc.Workload("azure-code", Path("b"), 2.0),
        sc.Workload("mooncake", Path("c"), 16.0, required=False),
    ]
    pairs = [
        *_cell("sharegpt", sc.GH200, _row(0.8, tbt=0.93)),  # +50, TBT -2: pass
        *_cell("sharegpt", sc.H200, _row(0.6, tput=970.0)),  # +30, 0.97x: fails tokens/s
        *_cell("azure-code", sc.GH200, _row(0.75, goodput=0.9)),  # +45, goodput 0.9x: (a) fails
        *_cell("azure-code", sc.H200, _row(0.55)),  # +25: pass
        *_cell("mooncake", sc.GH200, _row(0.3)),  # no gain, not required
        *_cell("mooncake", sc.H200, _row(0.3)),
    ]
    judgments = sc.judge(pairs, workloads)
    verdicts = {(j.kind, j.workload, j.profile): j.passed for j in judgments}
    assert verdicts[("b", "sharegpt", sc.GH200)]
    assert not verdicts[("b", "sharegpt", sc.H200)]
    assert not verdicts[("a", "azure-code", sc.GH200)] and verdicts[("b", "azure-code", sc.GH200)]
    assert not verdicts[("b", "mooncake", sc.GH200)]
    assert all(j.line().startswith(("PASS (", "FAIL (")) for j in judgments)
    summary = sc.summarize(pairs, judgments)
    assert summary["worst_goodput_ratio"] == pytest.approx(0.9)
    assert summary["worst_tput_ratio"] == pytest.approx(0.97)
    assert summary["gh200_gain_pts"] == pytest.approx(45.0)  # min over sharegpt, azure-code
    assert summary["h200_gain_pts"] == pytest.approx(25.0)
    assert summary["tbt_delta_pts"] == pytest.approx(-2.0)
    line = sc.result_line(summary)
    assert RESULT_RE.match(line)
    assert "gh200_gain_pts=45.0" in line
    assert "gh200_memory_gap_pts=nan" in line  # no reference runs here


def test_the_ample_hbm_reference_reads_what_memory_costs_vllm() -> None:
    cell = [sc.Pair("t", sc.GH200, 1.0, 8.0, _row(0.4), _row(0.6))]  # +20 pts
    judgment = replace(sc.judge_contended(cell, required=True), ample_ttft=0.65)
    assert judgment.memory_gap_pts == pytest.approx(25.0)
    assert "memory costs vllm 25.0 pts" in judgment.reference_line()
    assert "(80 %)" in judgment.reference_line()
    summary = sc.summarize(cell, [sc.judge_ratios(cell), judgment])
    assert summary["gh200_memory_gap_pts"] == pytest.approx(25.0)
    assert math.isnan(summary["h200_memory_gap_pts"])


def test_no_contended_rate_fails_and_reads_nan() -> None:
    cell = [sc.Pair("t", sc.GH200, 1.0, 4.0, _row(0.9), _row(0.9))]
    judgment = sc.judge_contended(cell, required=True)
    assert not judgment.passed and "no contended rate" in judgment.text
    summary = sc.summarize(cell, [sc.judge_ratios(cell), judgment])
    assert math.isnan(summary["gh200_gain_pts"])
    assert RESULT_RE.match(sc.result_line(summary))


def _azure_csv(path: Path, rows: int = 400) -> Path:
    """An Azure-format trace: one request every 0.5 s, 1,500-3,000 prompt and 50-200 output
    tokens (deterministic)."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(rows):
        t_s = 0.5 * i
        whole, frac = int(t_s), round((t_s % 1) * 1e7)
        stamp = f"2023-11-16 18:{whole // 60 % 60:02d}:{whole % 60:02d}.{frac:07d}"
        lines.append(f"{stamp},{1500 + 37 * i % 1500},{50 + 13 * i % 150}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_trace_not_in_the_kit_is_sized_and_searched(tmp_path: Path, capsys) -> None:
    trace = _azure_csv(tmp_path / "mine.csv")
    w = sc.other_workload(trace)
    assert w.required and not w.knees and w.start_rps > 0
    assert math.log2(w.hbm_kv_gib).is_integer()  # a power of two that holds 16 mean requests
    assert w.hbm_kv_gib * sc.GIB >= 16 * 2300 * 131072
    out = tmp_path / "out"
    argv = ["--quick", "--trace", str(trace), "--out", str(out), "--workers", "1"]
    assert sc.main([*argv, "--no-plots", "--hbm-gib", "1", "--duration", "5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert RESULT_RE.match(lines[-1])
    assert any("search mine" in line for line in lines)
    assert sum(line.startswith(("PASS (", "FAIL (")) for line in lines) == 4
    data = json.loads((out / "sched_compare.json").read_text())
    assert {c["profile"] for c in data["calibration"]} == set(sc.PROFILES)
    assert all(not c["knee_from_table"] and c["probes"] for c in data["calibration"])
    assert len(data["pairs"]) == 4 and len(data["results"]) == 8
    assert set(data["summary"]) == {
        "worst_goodput_ratio",
        "worst_tput_ratio",
        "gh200_gain_pts",
        "h200_gain_pts",
        "tbt_delta_pts",
        "gh200_memory_gap_pts",
        "h200_memory_gap_pts",
    }
    judged = [j for j in data["judgments"] if j["kind"] == "b" and j["rps"] is not None]
    assert all(0 <= j["ample_hbm_vllm_ttft"] <= 1 for j in judged)  # the reference ran


@pytest.mark.slow
def test_quick_on_the_kit(tmp_path: Path, capsys) -> None:
    if not (sc.TRACES / sc.KIT[0][1]).is_file():
        pytest.skip(f"the kit's traces are not in {sc.TRACES}")
    argv = ["--quick", "--trace", "sharegpt", "--trace", "azure-code", "--workers", "1"]
    assert sc.main([*argv, "--out", str(tmp_path), "--no-plots"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert RESULT_RE.match(lines[-1])
    for name in ("sharegpt", "azure-code"):
        for profile in sc.PROFILES:
            assert any(line.startswith(f"== {name} on {profile}") for line in lines)
    data = json.loads((tmp_path / "sched_compare.json").read_text())
    assert all(c["knee_from_table"] for c in data["calibration"])  # --quick: no search
    assert all(d["num_clipped"] == 0 for d in data["details"])
