"""bench/sched_compare.py: the rates swept and two short end-to-end runs (a small trace not
in the kit, which takes the search path; and ``--quick`` on two of the kit's traces). The runs
check the report's shape, not its figures: the policies under test change."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from bench import sched_compare as sc
from bench.sched_capacity import FREE_LINK_SCALE, ceiling_job
from bench.sched_judge import AMPLE_HBM_GIB
from tests.bench.test_sched_judge import RESULT_RE


def test_sweep_rates() -> None:
    rates = sc.sweep_rates(8.86, quick=False)
    assert [f for f, _ in rates] == list(sc.RATE_FACTORS)
    assert [r for _, r in rates] == [2.2, 4.4, 6.6, 8.9, 11.0, 13.0, 18.0]
    assert [r for _, r in sc.sweep_rates(8.86, quick=True)] == [4.4, 18.0]


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
    argv = ["--quick", "--trace", str(trace), "--out", str(out), "--workers", "1", "--ceilings"]
    assert sc.main([*argv, "--no-plots", "--hbm-gib", "1", "--duration", "5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert RESULT_RE.match(lines[-1])
    assert any("search mine" in line for line in lines)
    assert sum(line.startswith(("PASS (", "FAIL (")) for line in lines) == 4
    data = json.loads((out / "sched_compare.json").read_text())
    assert {c["profile"] for c in data["calibration"]} == set(sc.PROFILES)
    assert all(not c["knee_from_table"] and c["probes"] for c in data["calibration"])
    assert len(data["pairs"]) == 4 and len(data["results"]) == 16  # 2 seeds (quick)
    summary = data["summary"]
    assert {"worst_goodput_ratio", "gh200_gain_pts_lo", "h200_memory_gap_pts"} <= set(summary)
    for gpu in ("h200", "gh200"):
        lo, mid, hi = (summary[f"capacity_ratio_mine_{gpu}{e}"] for e in ("_lo", "", "_hi"))
        assert lo <= mid <= hi
    assert any(line.startswith("mine         h200-llama3-8b   vllm ") for line in lines)
    assert [len(c["capacity_rps"]["lvf"]) for c in data["capacity"]] == [2, 2]
    for cell in data["capacity"]:  # the ceilings: vllm with more HBM serves at least as much
        found = cell["capacity_rps"]
        assert set(found) == {"vllm", "lvf", "lvf-free-link", "vllm-ample-hbm"}
        assert sum(found["vllm-ample-hbm"]) >= sum(found["vllm"])
    assert {"capacity_free_link_mine_h200", "capacity_ample_hbm_mine_gh200_lo"} <= set(summary)
    judged = [j for j in data["judgments"] if j["kind"] == "b" and j["rps"] is not None]
    assert all(0 <= j["ample_hbm_vllm_ttft"] <= 1 for j in judged)  # the reference ran


def test_ceiling_jobs_change_only_the_link_or_the_hbm() -> None:
    w = sc.kit_workloads(sc.TRACES)[0]  # ShareGPT, 16 GiB
    args = sc.parse_args(["--quick"])
    base = sc.make_job(w, "h200-llama3-8b", 3.0, "lvf", args, seed=1)
    free = ceiling_job(replace(base, label="lvf-free-link"))
    assert free.policy == "lvf" and free.setup.hbm_kv_gib == w.hbm_kv_gib
    assert free.setup.profile.link_h2d_bytes_s == FREE_LINK_SCALE * 51.4e9
    ample = ceiling_job(
        replace(sc.make_job(w, "h200-llama3-8b", 3.0, "vllm", args), label="vllm-ample-hbm")
    )
    assert ample.policy == "vllm" and ample.setup.hbm_kv_gib == AMPLE_HBM_GIB
    assert ample.setup.profile == base.setup.profile and ceiling_job(base) is base


@pytest.mark.slow
def test_quick_on_the_kit(tmp_path: Path, capsys) -> None:
    if not (sc.TRACES / sc.KIT[0][1]).is_file():
        pytest.skip(f"the kit's traces are not in {sc.TRACES}")
    argv = ["--quick", "--trace", "sharegpt", "--trace", "azure-code", "--workers", "1"]
    argv += ["--seeds", "1"]  # the interval code is tested in test_sched_judge.py; CI time
    assert sc.main([*argv, "--out", str(tmp_path), "--no-plots"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert RESULT_RE.match(lines[-1])
    for name in ("sharegpt", "azure-code"):
        for profile in sc.PROFILES:
            assert any(line.startswith(f"== {name} on {profile}") for line in lines)
    data = json.loads((tmp_path / "sched_compare.json").read_text())
    assert all(c["knee_from_table"] for c in data["calibration"])  # --quick: no search
    assert all(d["num_clipped"] == 0 for d in data["details"])
