"""The simulator: the real engine, KV managers and policies in virtual time (no tensors)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from data_plane.engine.engine import Engine
from data_plane.engine.sampling import SamplingParams
from data_plane.transfer.base import BlockCopy
from lab.costmodel import (
    iteration_time_s,
    load_profile,
    plan_time_s,
    prefill_attention_pairs,
    transfer_time_s,
)
from lab.sim import (
    ROW_KEYS,
    DuplexLink,
    SimResult,
    SimSetup,
    SimulatedTransferEngine,
    VirtualClock,
    naive_link,
    run_simulation,
    simulate,
    simulator,
)
from lab.sim.cli import add_simulate_arguments, run_simulate
from lab.sim.setup import SimParts, build_parts
from lab.traces import TraceRequest, load_trace
from shared.policy import PAPER_LVF, POLICY_NAMES, Knobs, Plan, Snapshot, columns_from_views
from shared.policy.columns import FLOAT_FIELDS, INT_FIELDS
from tests.data_plane.views import view_by_name

H200 = load_profile("h200-llama3-8b")
GH200 = load_profile("gh200-llama3-8b")
MIB = 1 << 20


def _trace(rps: float, duration_s: float, spec: str = "synthetic:512:128") -> list[TraceRequest]:
    return load_trace(spec, rps=rps, duration_s=duration_s, num_requests=None, seed=1)


def test_builds_the_real_engine_without_tensors() -> None:
    parts = build_parts("lvf", Knobs(), SimSetup(H200, hbm_kv_gib=1.0, dram_kv_gib=2.0))
    assert isinstance(parts.engine, Engine)
    assert parts.engine.kv.has_dram
    # 1 GiB / 2 MiB per Llama-3-8B block of 16 tokens
    assert parts.engine.kv.hbm.num_blocks == 512 and parts.engine.kv.block_size == 16
    assert parts.transfer is not None and parts.transfer.block_bytes == 2 * MIB


def test_single_request_times_follow_the_cost_model() -> None:
    prompt, output = 1000, 4
    result = run_simulation(
        [TraceRequest(0.5, prompt, output)], "vllm", Knobs(), SimSetup(H200, hbm_kv_gib=1.0)
    )
    times = result.timelines[0].token_times_s
    assert len(times) == output
    # TTFT: planning over a snapshot of one request, then one prefill iteration of the whole
    # prompt (its attention over prompt x (prompt + 1) / 2 query-key pairs), from arrival
    plan_s = plan_time_s(H200, 1)
    prefill_s = iteration_time_s(H200, prompt, 0, prompt, prefill_attention_pairs(0, prompt))
    assert plan_s > 0 and times[0] - 0.5 == pytest.approx(plan_s + prefill_s)
    for k in range(1, output):  # then one decode per token, attending to prompt + k tokens
        decode_s = iteration_time_s(H200, 0, 1, prompt + k)
        assert times[k] - times[k - 1] == pytest.approx(plan_s + decode_s)
    assert result.row["ttft_p50_s"] == pytest.approx(plan_s + prefill_s)
    assert result.plan_s == pytest.approx(output * plan_s)
    assert result.interference_s == 0.0  # vLLM has no host tier: no copies


def test_row_has_exactly_the_keys() -> None:
    row = simulate(_trace(2, 2), "vllm", Knobs(), H200, 1.0, 0.0)
    assert tuple(row) == ROW_KEYS
    assert row["num_requests"] == len(_trace(2, 2)) and row["policy"] == "vllm"


def _assert_complete_and_clean(result: SimResult, trace: list[TraceRequest]) -> None:
    assert [len(t.token_times_s) for t in result.timelines] == [r.output_len for r in trace]
    assert result.leaked_hbm_blocks == 0 and result.leaked_dram_blocks == 0
    assert result.num_rejected == 0


def test_vllm_preempts_by_recompute_when_hbm_is_small() -> None:
    trace = _trace(20, 3)
    result = run_simulation(trace, "vllm", Knobs(), SimSetup(H200, hbm_kv_gib=0.5))
    assert result.row["preemptions"] > 0 and result.row["rotations"] == 0
    assert result.row["bytes_h2d"] == 0  # vLLM V1 has no host tier
    _assert_complete_and_clean(result, trace)


def test_lvf_rotates_through_dram_and_respects_the_budget() -> None:
    trace = _trace(20, 2)
    setup = SimSetup(GH200, hbm_kv_gib=0.5, dram_kv_gib=4.0, b_xfer=64)
    result = run_simulation(trace, "lvf", Knobs(), setup)
    assert result.row["rotations"] > 0
    assert result.row["bytes_h2d"] > 0 and result.row["bytes_d2h"] > 0
    assert 0 < result.max_blocks_per_iteration <= 64
    _assert_complete_and_clean(result, trace)


def test_engine_columns_make_the_same_lvf_run_as_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine hands LVF columns (waiting queue kept as arrays, numpy LVF); a run on views
    (the object LVF) makes the same decisions, token for token."""
    trace = _trace(20, 2)
    setup = SimSetup(GH200, hbm_kv_gib=0.5, dram_kv_gib=4.0, b_xfer=64)
    on_columns = run_simulation(trace, "lvf", Knobs(), setup)

    def on_views(*args: object) -> SimParts:
        parts = build_parts(*args)  # type: ignore[arg-type]
        assert parts.engine.columnar
        parts.engine.columnar = False
        return parts

    monkeypatch.setattr(simulator, "build_parts", on_views)
    views = run_simulation(trace, "lvf", Knobs(), setup)
    assert on_columns.row["rotations"] > 0 and on_columns.row["preemptions"] >= 0
    assert on_columns.row == views.row
    assert on_columns.num_iterations == views.num_iterations
    assert on_columns.timelines == views.timelines


def test_auto_budget_follows_the_last_iteration() -> None:
    setup = SimSetup(GH200, hbm_kv_gib=0.5, dram_kv_gib=4.0, b_xfer="auto")
    result = run_simulation(_trace(20, 1), "lvf", Knobs(), setup)
    # GH200 link 179.37 GB/s, 2 MiB blocks: ~85 blocks per ms of iteration
    shortest = iteration_time_s(GH200, 0, 1, 0)
    assert min(result.b_xfer_history) >= int(179.37e9 * shortest / (2 * MIB)) - 1
    assert max(result.b_xfer_history) > min(result.b_xfer_history)


def test_light_load_gives_identical_results_for_every_policy() -> None:
    trace = _trace(2, 5)
    # without copy/compute interference: the eager-sync copies of the policies with a DRAM
    # tier run under the compute for free, so every policy makes the same run
    free = dataclasses.replace(H200, copy_compute_overlap_efficiency=1.0)
    rows = [simulate(trace, p, Knobs(), free, 4.0, 8.0) for p in POLICY_NAMES]
    # Everything but the eager-sync traffic of the policies that have a DRAM tier
    strip = [{k: v for k, v in r.items() if k not in ("policy", "bytes_d2h")} for r in rows]
    assert all(s == strip[0] for s in strip)
    assert strip[0]["ttft_attainment"] == 1.0 and strip[0]["preemptions"] == 0
    assert strip[0]["rotations"] == 0 and strip[0]["bytes_h2d"] == 0
    # with the measured interference (0.90) the eager syncs slow LVF's iterations a little;
    # vLLM, which copies nothing, is not charged
    assert simulate(trace, "vllm", Knobs(), H200, 4.0, 8.0) == rows[POLICY_NAMES.index("vllm")]
    lvf = simulate(trace, "lvf", Knobs(), H200, 4.0, 8.0)
    assert lvf["bytes_d2h"] > 0 and lvf["ttft_p50_s"] > strip[0]["ttft_p50_s"]


def test_a_prompt_larger_than_hbm_is_clipped_not_fatal() -> None:
    result = run_simulation(
        [TraceRequest(0.0, 20_000, 50), TraceRequest(0.1, 100, 5)],
        "lvf",
        Knobs(),
        SimSetup(H200, hbm_kv_gib=0.25, dram_kv_gib=1.0),
    )
    assert result.num_clipped == 1 and result.num_rejected == 0
    assert len(result.timelines[1].token_times_s) == 5
    assert result.leaked_hbm_blocks == 0


def test_transfer_engine_completes_in_virtual_time() -> None:
    clock = VirtualClock(1.0)
    engine = SimulatedTransferEngine(clock, DuplexLink(H200), 2 * MIB)
    copies = [BlockCopy(i, i) for i in range(100)]
    h2d, d2h = engine.submit(copies, copies[:50])
    assert h2d is not None and d2h is not None and not h2d.done()
    seconds = transfer_time_s(H200, 100 * 2 * MIB, 50 * 2 * MIB)
    second, _ = engine.submit(copies, [])  # queued behind the first batch on the link
    assert second is not None
    clock.advance(seconds / 2)
    h2d.wait()  # nothing else to do: the clock jumps to the completion, counted as exposed
    assert clock.now == pytest.approx(1.0 + seconds)
    assert engine.exposed_transfer_s == pytest.approx(seconds / 2)
    assert d2h.done() and not second.done()
    second.wait()
    assert clock.now == pytest.approx(1.0 + seconds + transfer_time_s(H200, 200 * MIB, 0))
    assert engine.stats.bytes_h2d == 200 * 2 * MIB and engine.stats.num_copy_calls == 3


def test_naive_link_is_slow_and_one_direction_at_a_time() -> None:
    link = naive_link(H200)
    # 64 KiB at 7.29 GB/s -> 7.71 us per call over the 51.4 GB/s DMA; 32 KiB segments of an
    # 8B-model block then move at 32 KiB / (7.71 + 0.64 us) = about 3.9 GB/s
    assert link.h2d_bytes_s == pytest.approx(3.92e9, rel=0.01)
    assert link.segments_per_block == 64
    h2d_s, d2h_s = link.completion_s(100 * MIB, 100 * MIB)
    assert d2h_s == pytest.approx(2 * h2d_s, rel=0.01)
    assert naive_link(GH200).h2d_bytes_s > link.h2d_bytes_s


def test_naive_transfer_and_no_eager_sync_still_finish_clean() -> None:
    trace = _trace(20, 1)
    setup = SimSetup(
        H200, hbm_kv_gib=0.5, dram_kv_gib=4.0, b_xfer=64, transfer="naive", eager_sync=False
    )
    result = run_simulation(trace, "lvf", Knobs(), setup)
    assert result.row["rotations"] > 0
    _assert_complete_and_clean(result, trace)


def test_horizon_cuts_the_run_and_counts_the_rest_unfinished() -> None:
    trace = _trace(20, 2)
    setup = SimSetup(H200, hbm_kv_gib=0.5, dram_kv_gib=4.0, b_xfer=64)
    result = run_simulation(trace, "lvf", Knobs(), setup, horizon_s=1.0)
    assert 1.0 <= result.virtual_s < 1.5
    assert result.num_unfinished > 0
    assert sum(not t.finished for t in result.timelines) == result.num_unfinished
    assert result.leaked_hbm_blocks == 0 and result.leaked_dram_blocks == 0
    assert result.row["tpot_attainment"] <= 1 - result.num_unfinished / len(trace)


def test_setup_validation() -> None:
    with pytest.raises(ValueError, match="transfer"):
        SimSetup(H200, 1.0, transfer="pcie")
    with pytest.raises(ValueError, match="b_xfer"):
        SimSetup(H200, 1.0, b_xfer="fast")
    with pytest.raises(ValueError, match="policy"):
        simulate([], "fifo", Knobs(), H200, 1.0, 0.0)


def test_cli_writes_json_and_plot(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    args = parser.parse_args(
        [
            "--trace",
            "synthetic:256:32",
            "--rps",
            "2,4",
            "--duration",
            "2",
            "--policies",
            "vllm,lvf",
            "--hbm-kv-gib",
            "1",
            "--dram-kv-gib",
            "2",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert run_simulate(args) == 0
    data = json.loads(out.read_text())
    assert set(data) >= {"config", "results"} and len(data["results"]) == 4
    assert data["config"]["profile"] == "h200-llama3-8b" and png.stat().st_size > 0
    bad = parser.parse_args(["--trace", "synthetic", "--rps", "x", "--json", str(out)])
    assert run_simulate(bad) == 2


def test_cli_link_scale_runs_on_a_faster_link(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    out = tmp_path / "sim.json"
    argv = ["--trace", "synthetic:256:32", "--rps", "4", "--duration", "1", "--json", str(out)]
    assert run_simulate(parser.parse_args([*argv, "--link-scale", "1000"])) == 0
    config = json.loads(out.read_text())["config"]
    assert config["link_scale"] == 1000 and config["profile"] == "h200-llama3-8b (link x1000)"
    assert run_simulate(parser.parse_args([*argv, "--link-scale", "0"])) == 2


def test_engine_views_carry_every_field_by_name() -> None:
    """The engine builds views positionally (speed); each field must land under its name."""
    setup = SimSetup(GH200, hbm_kv_gib=0.1, dram_kv_gib=1.0, b_xfer=8)
    engine = build_parts("lvf", Knobs(), setup).engine
    engine.columnar = False
    for i in range(12):
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        engine.add_request(f"q{i}", [1] * (100 + 37 * i), params, priority=i % 3, t_arr_s=0.01 * i)
    for _ in range(30):
        engine.step()
    snapshot = engine.snapshot(engine.clock())
    states = {view.state for view in snapshot.requests}
    assert len(states) >= 2 and any(view.num_blocks_hbm for view in snapshot.requests)
    for view in snapshot.requests:
        request = engine.requests[view.request_id]
        table = engine.kv.table(view.request_id)
        expected = view_by_name(
            request,
            num_blocks_hbm=table.num_hbm if table else 0,
            num_blocks_dram=table.num_dram if table else 0,
            resident=engine.kv.is_resident(request.request_id),
        )
        assert view == expected


def test_kept_columns_match_the_views_the_planner_saw() -> None:
    """The worker publishes the step's columns (from the queues' cached columns) as its wire
    snapshot: every iteration they must equal the planner's views, row for row."""
    setup = SimSetup(GH200, hbm_kv_gib=0.1, dram_kv_gib=1.0, b_xfer=8)
    engine = build_parts("lvf", Knobs(**PAPER_LVF), setup).engine
    engine.columnar, engine.keep_columns = False, True
    seen: list[Snapshot] = []
    planner = engine.planner

    def spy(snapshot: Snapshot) -> Plan:
        seen.append(snapshot)
        return planner(snapshot)

    engine.planner = spy  # type: ignore[assignment]
    for i in range(12):
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        engine.add_request(f"q{i}", [1] * (100 + 37 * i), params, t_arr_s=0.01 * i)
    states_seen = set()
    for _ in range(60):
        got, expected = engine.step().columns, columns_from_views(seen[-1].requests)
        assert got is not None and list(got.request_ids) == list(expected.request_ids)
        for name in ("states", *INT_FIELDS, "resident"):
            assert np.array_equal(getattr(got, name), getattr(expected, name)), name
        for name in FLOAT_FIELDS:
            assert np.array_equal(getattr(got, name), getattr(expected, name), equal_nan=True)
        states_seen.update(got.states.tolist())
    assert states_seen == {0, 1, 2}  # waiting, running and rotary rows were all compared


def test_a_request_stops_at_the_hbm_pool_not_at_the_model_context() -> None:
    """A request may not grow past what HBM holds (the model's context can be far larger):
    it ends with "length" there, instead of rotating out for good and, at the head of L,
    holding the room every request ranked below it waits for (a worker that serves nothing)."""
    setup = SimSetup(GH200, hbm_kv_gib=0.02, dram_kv_gib=1.0, b_xfer=64, max_num_seqs=8)
    parts = build_parts("lvf", Knobs(), setup)
    kv = parts.engine.kv
    engine = Engine(
        executor=parts.executor,
        kv=kv,
        planner=parts.engine.planner,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_num_seqs=setup.max_num_seqs,
        max_model_len=10**6,  # a model's context, as a worker passes it
        clock=parts.clock,
        columnar=True,
    )
    capacity = kv.hbm.num_blocks * kv.block_size
    assert engine.max_model_len == capacity + 1
    engine.add_request(
        "long", [1] * (capacity - 5), SamplingParams(max_tokens=100, ignore_eos=True)
    )
    reasons: dict[str, str] = {}
    for step in range(3000):
        if step % 20 == 0 and step < 1500:
            small = SamplingParams(max_tokens=5, ignore_eos=True)
            engine.add_request(f"s{step}", [1] * 20, small, t_arr_s=parts.clock.now)
        for out in engine.step().outputs:
            if out.finished:
                reasons[out.request_id] = str(out.finish_reason)
    assert len(reasons) == 76 and not engine.has_unfinished()
    assert reasons["long"] == "length"
