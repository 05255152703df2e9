"""The simulator's charges beyond one iteration's compute: copy/compute interference (copies
running under the compute slow it down) and the policy's planning time on every step."""

from __future__ import annotations

import dataclasses

import pytest

from data_plane.engine.executor import BatchItem
from data_plane.engine.request import Request
from data_plane.engine.sampling import SamplingParams
from data_plane.transfer.base import BlockCopy
from lab.costmodel import (
    copy_interference_s,
    iteration_time_s,
    load_profile,
    plan_time_s,
    prefill_attention_pairs,
    transfer_time_s,
)
from lab.sim import (
    DuplexLink,
    SimSetup,
    SimulatedExecutor,
    SimulatedTransferEngine,
    VirtualClock,
    run_simulation,
    simulator,
)
from lab.sim.setup import ChargedPlanner, SimParts, build_parts
from lab.traces import TraceRequest, load_trace
from shared.policy import (
    POLICY_NAMES,
    ColumnarSnapshot,
    Knobs,
    Plan,
    Snapshot,
    columnar_from_snapshot,
)

H200 = load_profile("h200-llama3-8b")
MIB = 1 << 20
EFFICIENCY = H200.copy_compute_overlap_efficiency


def _prefill_item(num_tokens: int, start: int = 0) -> BatchItem:
    request = Request("r", [1] * (start + num_tokens), SamplingParams(), 0.0, 0)
    request.num_computed_tokens = start
    return BatchItem(request, num_tokens, [])


def _parts() -> tuple[VirtualClock, SimulatedTransferEngine, SimulatedExecutor]:
    clock = VirtualClock(1.0)
    transfer = SimulatedTransferEngine(clock, DuplexLink(H200), 2 * MIB)
    return clock, transfer, SimulatedExecutor(clock, H200, copies=transfer)


def _copies(n: int) -> list[BlockCopy]:
    return [BlockCopy(i, i) for i in range(n)]


def test_executor_charges_prefill_attention() -> None:
    clock, _, executor = _parts()
    executor.execute([_prefill_item(1000, start=3000)])  # a chunk late in a long prompt
    expected = iteration_time_s(H200, 1000, 0, 4000, prefill_attention_pairs(3000, 1000))
    assert clock.now - 1.0 == pytest.approx(expected)
    assert expected > iteration_time_s(H200, 1000, 0, 4000)


def test_no_interference_without_copies_in_flight() -> None:
    clock, transfer, executor = _parts()
    compute = iteration_time_s(H200, 2048, 0, 2048, prefill_attention_pairs(0, 2048))
    executor.execute([_prefill_item(2048)])
    assert clock.now - 1.0 == pytest.approx(compute) and executor.interference_s == 0.0
    # copies that finished before the compute starts do not interfere either
    transfer.submit(_copies(10), [])
    clock.advance(1.0)
    executor.execute([_prefill_item(2048)])
    assert executor.last_iteration_s == pytest.approx(compute)
    assert executor.interference_s == 0.0


def test_interference_for_copies_longer_than_the_compute() -> None:
    clock, transfer, executor = _parts()
    compute = iteration_time_s(H200, 2048, 0, 2048, prefill_attention_pairs(0, 2048))
    blocks = 2000  # 4 GB each way: far longer than the ~60 ms prefill
    transfer.submit(_copies(blocks), _copies(blocks))
    assert transfer_time_s(H200, blocks * 2 * MIB, blocks * 2 * MIB) > compute
    executor.execute([_prefill_item(2048)])
    assert executor.last_iteration_s == pytest.approx(compute / EFFICIENCY)
    assert clock.now - 1.0 == pytest.approx(compute / EFFICIENCY)


def test_interference_for_copies_shorter_than_the_compute() -> None:
    clock, transfer, executor = _parts()
    compute = iteration_time_s(H200, 2048, 0, 2048, prefill_attention_pairs(0, 2048))
    clock.advance(0.001)
    transfer.submit(_copies(100), [])  # queued behind nothing; ~4 ms of H2D
    copy_s = transfer_time_s(H200, 100 * 2 * MIB, 0)
    assert transfer.busy_s_between(clock.now, clock.now + compute) == pytest.approx(copy_s)
    executor.execute([_prefill_item(2048)])
    extra = copy_interference_s(H200, compute, copy_s)
    assert extra == pytest.approx((1 / EFFICIENCY - 1) * copy_s) and extra > 0
    assert executor.last_iteration_s == pytest.approx(compute + extra)
    assert executor.interference_s == pytest.approx(extra)


def test_busy_time_counts_only_the_queue_still_ahead() -> None:
    clock = VirtualClock()
    transfer = SimulatedTransferEngine(clock, DuplexLink(H200), 2 * MIB)
    assert transfer.busy_s_between(0.0, 1.0) == 0.0
    transfer.submit(_copies(100), [])
    transfer.submit(_copies(100), [])  # queued behind the first: the link is busy twice as long
    one = transfer_time_s(H200, 100 * 2 * MIB, 0)
    assert transfer.busy_s_between(0.0, 1.0) == pytest.approx(2 * one)
    assert transfer.busy_s_between(0.0, one / 2) == pytest.approx(one / 2)
    clock.advance(1.5 * one)
    assert transfer.busy_s_between(clock.now, 1.0) == pytest.approx(one / 2)
    assert transfer.busy_s_between(3 * one, 1.0) == 0.0


def test_charged_planner_counts_the_snapshot_for_views_and_columns() -> None:
    profile = dataclasses.replace(H200, plan_fixed_s=0.01, plan_per_request_s=0.001)
    parts = build_parts("lvf", Knobs(), SimSetup(profile, hbm_kv_gib=1.0, dram_kv_gib=1.0))
    engine = parts.engine
    for i in range(5):
        engine.add_request(f"q{i}", [1] * 64, SamplingParams(max_tokens=4), t_arr_s=0.0)
    seen: list[int] = []

    def plan(snapshot: Snapshot | ColumnarSnapshot) -> Plan:
        seen.append(len(snapshot.requests))
        return Plan()

    planner = ChargedPlanner(plan, parts.clock, profile)
    snapshot = engine.snapshot(0.0)
    planner(snapshot)
    planner(columnar_from_snapshot(snapshot))
    assert seen == [5, 5] and planner.num_calls == 2
    assert parts.clock.now == pytest.approx(2 * (0.01 + 5 * 0.001))
    assert planner.t_planned_s == parts.clock.now and planner.plan_s == pytest.approx(0.03)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_step_pays_planning_for_every_policy(policy: str) -> None:
    profile = dataclasses.replace(H200, plan_fixed_s=0.002, plan_per_request_s=0.001)
    prompt, output = 500, 5
    setup = SimSetup(profile, hbm_kv_gib=1.0, dram_kv_gib=1.0)
    result = run_simulation([TraceRequest(0.5, prompt, output)], policy, Knobs(), setup)
    times = result.timelines[0].token_times_s
    plan_s = plan_time_s(profile, 1)  # one request in every snapshot
    prefill_s = iteration_time_s(profile, prompt, 0, prompt, prefill_attention_pairs(0, prompt))
    # eager syncs may run under the prefill (policies with a DRAM tier): at most 1/0.9 of it
    ttft = times[0] - 0.5
    assert plan_s + prefill_s - 1e-12 <= ttft <= plan_s + prefill_s / EFFICIENCY + 1e-12
    for k in range(1, output):
        decode_s = times[k] - times[k - 1] - plan_s
        assert iteration_time_s(profile, 0, 1, prompt + k) - 1e-12 <= decode_s
        assert decode_s <= iteration_time_s(profile, 0, 1, prompt + k) / EFFICIENCY + 1e-12
    assert result.plan_s == pytest.approx(output * plan_s)


def test_a_policy_that_never_schedules_is_still_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning moves the clock on every step, so the stall check must not take a step that
    only planned for progress."""

    def idle(*args: object) -> SimParts:
        parts = build_parts(*args)  # type: ignore[arg-type]
        parts.planner.planner = lambda snapshot: Plan()
        return parts

    monkeypatch.setattr(simulator, "build_parts", idle)
    trace = load_trace("synthetic:64:4", rps=4, duration_s=0.5, num_requests=None, seed=1)
    slow = dataclasses.replace(H200, plan_fixed_s=0.5)
    # MAX_STALL_S of stall ticks, each after 0.5 s of planning, come well before the horizon
    with pytest.raises(simulator.SimulationStuck, match="no progress"):
        run_simulation(trace, "vllm", Knobs(), SimSetup(slow, hbm_kv_gib=1.0), horizon_s=1e4)
