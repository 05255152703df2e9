"""`superinfer profile`: the fit on synthetic steps with known coefficients, the batch shape
counted as the simulator counts it, and a real (tiny) run whose JSON `simulate` accepts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from lab.costmodel import iteration_time_s, load_profile
from lab.profile import batch_shape
from lab.profile_fit import StepSample, fit_step_costs
from lab.sim import SimSetup, simulate
from lab.traces import TraceRequest
from shared.policy import Knobs
from superinfer.cli import main as cli_main


def _samples(intercept: float, per_prefill: float, per_context: float) -> list[StepSample]:
    shapes = [(p, 0, p) for p in (16, 64, 256)] + [(0, b, b * c) for b in (1, 8) for c in (32, 256)]
    return [
        StepSample(p, d, c, intercept + per_prefill * p + per_context * c)
        for p, d, c in shapes
        for _ in range(3)
    ]


def test_fit_recovers_known_costs() -> None:
    samples = _samples(0.002, 4e-5, 1e-6)
    samples.append(StepSample(64, 0, 64, 0.9))  # one step stalled by another process
    fit = fit_step_costs(samples)
    assert fit.intercept_s == pytest.approx(0.002, rel=1e-6)
    assert fit.prefill_token_s == pytest.approx(4e-5, rel=1e-6)
    assert fit.context_token_s == pytest.approx(1e-6, rel=1e-6)
    assert fit.r_squared == pytest.approx(1.0) and fit.num_samples == len(samples)


def test_fit_keeps_coefficients_non_negative() -> None:
    # Time that falls with context (noise): the context cost is fixed at 0, the rest refitted.
    samples = [StepSample(p, 0, c, 0.001 + 1e-5 * p - 1e-7 * c) for p, c in
               [(0, 10), (0, 500), (100, 100), (200, 600), (50, 1000)]]  # fmt: skip
    fit = fit_step_costs(samples)
    assert fit.context_token_s == 0.0 and fit.intercept_s > 0 and fit.prefill_token_s > 0
    with pytest.raises(ValueError, match="distinct step shapes"):
        fit_step_costs(samples[:2])


def test_batch_shape_counts_like_the_simulator() -> None:
    def item(computed: int, num_tokens: int) -> SimpleNamespace:
        return SimpleNamespace(request=SimpleNamespace(num_computed_tokens=computed),
                               num_tokens=num_tokens)  # fmt: skip

    # a decode at 40, a first chunk of 32, a later chunk of 16 after 32, a 1-token prompt
    items = [item(40, 1), item(0, 32), item(32, 16), item(0, 1)]
    assert batch_shape(items) == (32 + 16 + 1, 1, 41 + 32 + 48 + 1)  # type: ignore[arg-type]


def test_profile_of_tiny_random_feeds_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    grid = "--prefill-tokens 8,32,64 --decode-batches 1,3 --contexts 8,24 --decode-steps 2"
    argv = ["profile", "--model", "tiny-random", "--out", str(out), *grid.split()]
    code = cli_main([*argv, "--repeats", "1", "--threads", "1"])
    assert code == 0
    document = json.loads(out.read_text())
    assert document["_fit"]["samples"] and "fixed_overhead_s" in document["_sources"]
    profile = load_profile(out)
    assert profile.name == "cpu-tiny-random" and profile.block_size_tokens == 16
    assert profile.kv_bytes_per_token == 4 * 2 * 2 * 32 * 4  # layers x K,V x heads x dim x fp32
    step_s = iteration_time_s(profile, 32, 0, 32)
    assert 0 < step_s < 1.0
    fit = document["_fit"]
    predicted_s = fit["intercept_s"] + 32 * fit["prefill_token_s"] + 32 * fit["context_token_s"]
    assert step_s == pytest.approx(predicted_s, rel=1e-6)  # the profile is the fit
    trace = [TraceRequest(0.01 * i, 24, 8) for i in range(10)]
    row = simulate(trace, "lvf", Knobs(), profile, hbm_kv_gib=0.001, dram_kv_gib=0.01)
    assert row["num_requests"] == 10 and row["ttft_attainment"] > 0
    assert SimSetup(profile, 0.001).num_hbm_blocks > 0
