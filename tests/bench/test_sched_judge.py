"""bench/sched_judge.py: the judgments, their seed intervals and the RESULT line on made-up
rows with answers worked out by hand."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from bench import sched_compare as sc
from bench import sched_judge as sj

RESULT_RE = re.compile(
    r"^RESULT sched_compare worst_goodput_ratio=\S+ worst_tput_ratio=\S+ "
    r"gh200_gain_pts=\S+ h200_gain_pts=\S+ tbt_delta_pts=\S+ "
    r"gh200_memory_gap_pts=\S+ h200_memory_gap_pts=\S+( \w+=\S+)*$"
)


def _row(ttft: float, tbt: float = 0.95, goodput: float = 1.0, tput: float = 1000.0) -> dict:
    return {
        "ttft_attainment": ttft,
        "tbt_attainment": tbt,
        "goodput_rps": goodput,
        "output_tokens_per_s": tput,
    }


def _cell(trace: str, profile: str, lvf_at_contended: dict) -> list[sj.Pair]:
    return [
        sj.Pair(trace, profile, 0.5, 4.0, _row(1.0), _row(1.0)),
        sj.Pair(trace, profile, 1.5, 12.0, _row(0.3), lvf_at_contended),
        sj.Pair(trace, profile, 2.0, 16.0, _row(0.2), _row(0.3, tbt=0.7)),
    ]


def test_judgments_and_result_line() -> None:
    workloads = [
        sc.Workload("sharegpt", Path("a"), 16.0),
        sc.Workload("azure-code", Path("b"), 2.0),
        sc.Workload("mooncake", Path("c"), 16.0, required=False),
    ]
    pairs = [
        *_cell("sharegpt", sj.GH200, _row(0.8, tbt=0.93)),  # +50, TBT -2: pass
        *_cell("sharegpt", sj.H200, _row(0.6, tput=970.0)),  # +30, 0.97x: fails tokens/s
        *_cell("azure-code", sj.GH200, _row(0.75, goodput=0.9)),  # +45, goodput 0.9x: (a) fails
        *_cell("azure-code", sj.H200, _row(0.55)),  # +25: pass
        *_cell("mooncake", sj.GH200, _row(0.3)),  # no gain, not required
        *_cell("mooncake", sj.H200, _row(0.3)),
    ]
    judgments = sj.judge(pairs, workloads)
    verdicts = {(j.kind, j.workload, j.profile): j.passed for j in judgments}
    assert verdicts[("b", "sharegpt", sj.GH200)]
    assert not verdicts[("b", "sharegpt", sj.H200)]
    assert not verdicts[("a", "azure-code", sj.GH200)] and verdicts[("b", "azure-code", sj.GH200)]
    assert not verdicts[("b", "mooncake", sj.GH200)]
    assert all(j.line().startswith(("PASS (", "FAIL (")) for j in judgments)
    summary = sj.summarize(pairs, judgments)
    assert summary["worst_goodput_ratio"] == pytest.approx(0.9)
    assert summary["worst_tput_ratio"] == pytest.approx(0.97)
    assert summary["gh200_gain_pts"] == pytest.approx(45.0)  # min over sharegpt, azure-code
    assert summary["h200_gain_pts"] == pytest.approx(25.0)
    assert summary["tbt_delta_pts"] == pytest.approx(-2.0)
    line = sj.result_line(summary)
    assert RESULT_RE.match(line)
    assert "gh200_gain_pts=45.0" in line
    assert "gh200_memory_gap_pts=nan" in line  # no reference runs here


def test_the_ample_hbm_reference_reads_what_memory_costs_vllm() -> None:
    cell = [sj.Pair("t", sj.GH200, 1.0, 8.0, _row(0.4), _row(0.6))]  # +20 pts
    judgment = replace(sj.judge_contended(cell, required=True), ample_ttft=0.65)
    assert judgment.memory_gap_pts == pytest.approx(25.0)
    assert "memory costs vllm 25.0 pts" in judgment.reference_line()
    assert "(80 % [80, 80])" in judgment.reference_line()  # one seed: no spread
    summary = sj.summarize(cell, [sj.judge_ratios(cell), judgment])
    assert summary["gh200_memory_gap_pts"] == pytest.approx(25.0)
    assert math.isnan(summary["h200_memory_gap_pts"])


def test_no_contended_rate_fails_and_reads_nan() -> None:
    cell = [sj.Pair("t", sj.GH200, 1.0, 4.0, _row(0.9), _row(0.9))]
    judgment = sj.judge_contended(cell, required=True)
    assert not judgment.passed and "no contended rate" in judgment.text
    summary = sj.summarize(cell, [sj.judge_ratios(cell), judgment])
    assert math.isnan(summary["gh200_gain_pts"])
    assert RESULT_RE.match(sj.result_line(summary))


def _seed_pair(vllm_ttfts: list[float], lvf_ttfts: list[float]) -> sj.Pair:
    vllm, lvf = tuple(map(_row, vllm_ttfts)), tuple(map(_row, lvf_ttfts))
    return sj.Pair("t", sj.GH200, 1.0, 8.0, sj.mean_row(vllm), sj.mean_row(lvf), vllm, lvf)


def test_a_gain_passes_only_when_its_interval_clears_the_threshold() -> None:
    steady = _seed_pair([0.3] * 5, [0.75, 0.74, 0.76, 0.75, 0.75])  # +45 every seed
    lucky = _seed_pair([0.3] * 5, [0.95, 0.9, 0.45, 0.92, 0.93])  # mean +53, one seed +15
    for pair, passed in ((steady, True), (lucky, False)):
        judgment = sj.judge_contended([pair], required=True)
        assert judgment.passed is passed, judgment.text
    gain = lucky.gain_interval()
    assert gain.value == pytest.approx(53.0)
    assert gain.lo < 40 <= gain.value <= gain.hi
    summary = sj.summarize([lucky], [sj.judge_contended([lucky], True)])
    assert summary["gh200_gain_pts"] == pytest.approx(53.0)
    assert summary["gh200_gain_pts_lo"] == pytest.approx(gain.lo)


def test_mean_row_and_merge_seeds() -> None:
    rows = [
        {"policy": "lvf", "ttft_attainment": 0.5, "rotations": 3, "ttft_p99_s": None},
        {"policy": "lvf", "ttft_attainment": 0.7, "rotations": 4, "ttft_p99_s": 2.0},
    ]
    assert sj.mean_row(rows) == {
        "policy": "lvf",
        "ttft_attainment": pytest.approx(0.6),
        "rotations": 4,  # ints stay ints (3.5 rounds to even)
        "ttft_p99_s": 2.0,  # None skipped
    }
    job = sc.make_job(
        sc.Workload("t", Path("synthetic"), 1.0), sj.H200, 2.0, "lvf", sc.parse_args([])
    )
    runs = [sj.Run("t", sj.H200, 1.0, replace(job, seed=s), r, {}) for s, r in enumerate(rows)]
    (merged,) = sj.merge_seeds(runs)
    assert merged.rows == tuple(rows) and merged.row["ttft_attainment"] == pytest.approx(0.6)


def test_gap_share_is_a_ratio_over_seeds() -> None:
    pair = _seed_pair([0.2, 0.4], [0.6, 0.6])  # gains 0.4 and 0.2
    judgment = replace(
        sj.judge_contended([pair], True), ample_ttft=0.8, ample_seeds=(0.7, 0.9)
    )  # gaps 0.5 and 0.5
    share = judgment.gap_share()
    assert share is not None and share.value == pytest.approx(0.6)
    assert share.lo == pytest.approx(0.4) and share.hi == pytest.approx(0.8)  # each seed alone
    summary = sj.summarize([pair], [judgment])
    assert summary["gap_share_t_gh200"] == pytest.approx(0.6)
    line = sj.result_line(summary)
    assert RESULT_RE.match(line) and "gap_share_t_gh200=0.600" in line
