"""Run the real engine, KV managers and policies over a request trace in virtual time.

Nothing is faked above the executor and the transfer engine: :class:`Engine` plans with
``shared.policy.make_plan``, the :class:`TieredKVCacheManager` does DuplexKV's bookkeeping
(eager sync, rotate out/in, the ``b_xfer_blocks`` budget), and only the model
(:class:`SimulatedExecutor`) and the copies (:class:`SimulatedTransferEngine`) are replaced by
the cost model. Requests enter at their arrival times; when the engine has nothing to do the
clock jumps to the next arrival. Every output token is stamped with the virtual time at the
end of the iteration that produced it; ``shared.metrics`` turns those timelines into a row.

Policies that never rotate (vllm, vllm-priority) run on an HBM-only KV manager, as vLLM V1
has no host tier; swap, edf and lvf get the DRAM tier when ``dram_kv_gib > 0``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from data_plane.engine.engine import Engine
from data_plane.engine.request import RequestError
from data_plane.engine.sampling import SamplingParams
from data_plane.kv.manager import KVCacheManager
from data_plane.kv.tiered import TieredKVCacheManager
from data_plane.sim.clock import VirtualClock
from data_plane.sim.executor import SimulatedExecutor
from data_plane.sim.transfer import DuplexLink, SimulatedTransferEngine, naive_link
from shared.costmodel import CostProfile, auto_b_xfer_blocks, iteration_time_s, kv_block_bytes
from shared.metrics import RequestTimeline, summarize
from shared.policy import POLICY_NAMES, Knobs, make_plan
from shared.traces import TraceRequest

GIB = 1 << 30
ROTATING_POLICIES = frozenset({"swap", "edf", "lvf"})
TRANSFERS = ("duplex", "naive")
ROW_KEYS = (
    "policy", "rps", "num_requests", "ttft_attainment", "tbt_attainment", "tpot_attainment",
    "goodput_rps", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s",
    "preemptions", "rotations", "bytes_h2d", "bytes_d2h", "exposed_transfer_s",
)
STALL_TICK_S = 0.01  # idle step with nothing in flight and no arrival left: let time pass
MAX_STALL_S = 60.0  # ... for this long, then the run is stuck (a policy that never schedules)
ProgressFn = Callable[[int, int], None]


class SimulationStuck(RuntimeError):
    """The engine made no progress for MAX_STALL_S of virtual time with nothing left to arrive."""


@dataclass(frozen=True, slots=True)
class SimSetup:
    """Hardware and engine sizes of one simulation (the policy and knobs come separately)."""

    profile: CostProfile
    hbm_kv_gib: float
    dram_kv_gib: float = 0.0
    b_xfer: int | str = "auto"  # blocks per iteration, or "auto" (link rate x last iteration)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    transfer: str = "duplex"  # duplex | naive
    eager_sync: bool = True
    b_xfer_rate_bytes_s: float | None = None  # link rate "auto" uses; default: the profile's

    def __post_init__(self) -> None:
        if not self.hbm_kv_gib > 0 or self.dram_kv_gib < 0:
            raise ValueError("hbm_kv_gib must be > 0 and dram_kv_gib >= 0")
        if self.transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, got {self.transfer!r}")
        if isinstance(self.b_xfer, str) and self.b_xfer != "auto":
            raise ValueError(f"b_xfer must be a block count or 'auto', got {self.b_xfer!r}")
        if isinstance(self.b_xfer, int) and self.b_xfer < 1:
            raise ValueError(f"b_xfer must be >= 1 block, got {self.b_xfer}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")

    @property
    def block_bytes(self) -> int:
        return kv_block_bytes(self.profile)

    @property
    def num_hbm_blocks(self) -> int:
        return int(self.hbm_kv_gib * GIB // self.block_bytes)

    @property
    def num_dram_blocks(self) -> int:
        return int(self.dram_kv_gib * GIB // self.block_bytes)


@dataclass(slots=True)
class SimResult:
    row: dict[str, Any]
    timelines: list[RequestTimeline]
    num_clipped: int = 0  # requests shortened to fit the whole HBM pool
    num_rejected: int = 0  # requests the engine refused (count as SLO misses)
    num_iterations: int = 0
    num_stalls: int = 0
    virtual_s: float = 0.0
    busy_s: float = 0.0  # virtual seconds spent computing
    wall_s: float = 0.0
    max_blocks_per_iteration: int = 0
    leaked_hbm_blocks: int = 0
    leaked_dram_blocks: int = 0
    b_xfer_history: list[int] = field(default_factory=list)  # sampled every 64 iterations


@dataclass(slots=True)
class _Parts:
    clock: VirtualClock
    engine: Engine
    executor: SimulatedExecutor
    transfer: SimulatedTransferEngine | None
    auto_profile: CostProfile | None  # set when b_xfer is "auto"


def simulate(
    trace_requests: Sequence[TraceRequest],
    policy: str,
    knobs: Knobs,
    profile: CostProfile,
    hbm_kv_gib: float,
    dram_kv_gib: float,
    b_xfer: int | str = "auto",
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    transfer: str = "duplex",
    eager_sync: bool = True,
    rps: float | None = None,
) -> dict[str, Any]:
    """One policy over one trace; returns the result row (keys :data:`ROW_KEYS`)."""
    setup = SimSetup(profile, hbm_kv_gib, dram_kv_gib, b_xfer, max_num_batched_tokens,
                     max_num_seqs, transfer, eager_sync)
    return run_simulation(trace_requests, policy, knobs, setup, rps=rps).row


def run_simulation(
    trace_requests: Sequence[TraceRequest],
    policy: str,
    knobs: Knobs,
    setup: SimSetup,
    rps: float | None = None,
    on_progress: ProgressFn | None = None,
) -> SimResult:
    """:func:`simulate` with the details (timelines, counters, leaks, wall time)."""
    if policy not in POLICY_NAMES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICY_NAMES)}")
    t0 = time.perf_counter()
    trace = sorted(trace_requests, key=lambda r: r.arrival_s)
    parts = _build(policy, knobs, setup)
    result = SimResult(row={}, timelines=[])
    times = _run(parts, trace, knobs, result, on_progress)
    _finish(parts, setup, result)
    result.timelines = [
        RequestTimeline(r.arrival_s, t, knobs.slo_ttft_s, knobs.slo_tbt_s)
        for r, t in zip(trace, times, strict=True)
    ]
    result.row = _row(policy, rps, trace, parts, result)
    result.wall_s = time.perf_counter() - t0
    return result


def _build(policy: str, knobs: Knobs, setup: SimSetup) -> _Parts:
    profile = setup.profile
    clock = VirtualClock()
    executor = SimulatedExecutor(clock, profile)
    auto_profile = None
    if setup.b_xfer == "auto":
        rate = setup.b_xfer_rate_bytes_s
        auto_profile = profile if rate is None else dataclasses.replace(
            profile, link_h2d_bytes_s=rate, link_d2h_bytes_s=rate)
        b_xfer = auto_b_xfer_blocks(auto_profile, iteration_time_s(profile, 0, 1, 0),
                                    setup.block_bytes)
    else:
        b_xfer = int(setup.b_xfer)
    transfer = None
    kv: KVCacheManager
    if policy in ROTATING_POLICIES and setup.num_dram_blocks > 0:
        link = DuplexLink(profile) if setup.transfer == "duplex" else naive_link(profile)
        transfer = SimulatedTransferEngine(clock, link, setup.block_bytes)
        kv = TieredKVCacheManager(setup.num_hbm_blocks, setup.num_dram_blocks,
                                  profile.block_size_tokens, transfer, b_xfer_blocks=b_xfer,
                                  eager_sync=setup.eager_sync)
    else:
        kv = KVCacheManager(setup.num_hbm_blocks, profile.block_size_tokens)
    plan_knobs = dataclasses.replace(knobs, policy=policy,
                                     b_xfer=None if auto_profile else b_xfer)
    engine = Engine(
        executor=executor,
        kv=kv,
        planner=lambda snapshot: make_plan(snapshot, plan_knobs),
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_num_seqs=setup.max_num_seqs,
        max_model_len=setup.num_hbm_blocks * profile.block_size_tokens + 1,
        clock=clock,
    )
    return _Parts(clock, engine, executor, transfer, auto_profile)


def _fit(request: TraceRequest, capacity_tokens: int) -> tuple[int, int]:
    """(prompt, output) lengths shortened so the request's KV fits the whole HBM pool: the
    output first, then the prompt (a request larger than HBM could never run)."""
    prompt = min(request.input_len, capacity_tokens - 1)
    output = max(1, min(request.output_len, capacity_tokens - prompt))
    return prompt, output


def _inject(parts: _Parts, index: int, request: TraceRequest, result: SimResult) -> None:
    engine = parts.engine
    capacity = engine.kv.hbm.num_blocks * engine.kv.block_size
    prompt, output = _fit(request, capacity)
    if (prompt, output) != (request.input_len, request.output_len):
        result.num_clipped += 1
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    try:
        engine.add_request(f"r{index}", [1] * prompt, params, t_arr_s=request.arrival_s)
    except RequestError:
        result.num_rejected += 1


def _run(
    parts: _Parts,
    trace: list[TraceRequest],
    knobs: Knobs,
    result: SimResult,
    on_progress: ProgressFn | None,
) -> list[list[float]]:
    clock, engine, executor = parts.clock, parts.engine, parts.executor
    times: list[list[float]] = [[] for _ in trace]
    by_id = {f"r{i}": t for i, t in enumerate(times)}
    nxt, n = 0, len(trace)
    stalled_s = 0.0
    num_done = 0
    while nxt < n or engine.has_unfinished():
        while nxt < n and trace[nxt].arrival_s <= clock.now:
            _inject(parts, nxt, trace[nxt], result)
            nxt += 1
        if not engine.has_unfinished():
            if nxt < n:
                clock.now = trace[nxt].arrival_s
            continue
        t_before, iters_before = clock.now, executor.num_iterations
        outputs = engine.step()
        now = clock.now
        for out in outputs:
            by_id[out.request_id].extend([now] * len(out.new_token_ids))
            num_done += out.finish_reason is not None
        if executor.num_iterations != iters_before:
            stalled_s = 0.0
            _update_b_xfer(parts, result)
        elif now == t_before:
            stalled_s = _stall(parts, trace, nxt, stalled_s, result)
        if on_progress is not None and engine.stats.num_iterations % 256 == 0:
            on_progress(num_done, n)
    if on_progress is not None:
        on_progress(num_done, n)
    return times


def _update_b_xfer(parts: _Parts, result: SimResult) -> None:
    kv = parts.engine.kv
    if parts.auto_profile is not None and parts.transfer is not None:
        kv.b_xfer_blocks = auto_b_xfer_blocks(parts.auto_profile,
                                              parts.executor.last_iteration_s,
                                              parts.transfer.block_bytes)
    if parts.executor.num_iterations % 64 == 0:
        result.b_xfer_history.append(kv.b_xfer_blocks)


def _stall(
    parts: _Parts, trace: list[TraceRequest], nxt: int, stalled_s: float, result: SimResult
) -> float:
    """A step computed nothing and waited on no copy: jump to the next arrival, or let a
    little time pass; raise once nothing happened for MAX_STALL_S."""
    result.num_stalls += 1
    clock = parts.clock
    if nxt < len(trace):
        clock.advance_to(trace[nxt].arrival_s)
        return 0.0
    clock.advance(STALL_TICK_S)
    stalled_s += STALL_TICK_S
    if stalled_s > MAX_STALL_S:
        engine = parts.engine
        raise SimulationStuck(
            f"no progress for {stalled_s:.0f} virtual s at t={clock.now:.3f}: "
            f"{len(engine.running)} running, {len(engine.waiting)} waiting, "
            f"{len(engine.rotary)} rotary, {engine.kv.hbm.num_free} free HBM blocks"
        )
    return stalled_s


def _finish(parts: _Parts, setup: SimSetup, result: SimResult) -> None:
    """Counters, then drain the copies still in flight (after the last token, so they do not
    count as exposed) and check that every block came back."""
    kv = parts.engine.kv
    result.num_iterations = parts.executor.num_iterations
    result.virtual_s = parts.clock.now
    result.busy_s = parts.executor.busy_s
    exposed = parts.transfer.exposed_transfer_s if parts.transfer else 0.0
    if isinstance(kv, TieredKVCacheManager):
        result.max_blocks_per_iteration = kv.tiered_stats.max_blocks_per_iteration
        kv.drain()
        result.leaked_dram_blocks = kv.dram.num_blocks - kv.dram.num_free
    if parts.transfer is not None:
        parts.transfer.exposed_transfer_s = exposed
    result.leaked_hbm_blocks = kv.hbm.num_blocks - kv.hbm.num_free


def _row(
    policy: str,
    rps: float | None,
    trace: list[TraceRequest],
    parts: _Parts,
    result: SimResult,
) -> dict[str, Any]:
    summary = summarize(result.timelines)
    if rps is None and len(trace) > 1 and trace[-1].arrival_s > trace[0].arrival_s:
        rps = (len(trace) - 1) / (trace[-1].arrival_s - trace[0].arrival_s)
    stats = parts.engine.stats
    transfer = parts.transfer
    row: dict[str, Any] = {
        "policy": policy,
        "rps": rps,
        "num_requests": len(trace),
        "ttft_attainment": summary.ttft_attainment,
        "tbt_attainment": summary.tbt_attainment,
        "tpot_attainment": summary.tpot_attainment,
        "goodput_rps": summary.goodput_rps,
        "output_tokens_per_s": summary.output_tokens_per_s,
        "ttft_p50_s": summary.ttft_p50_s,
        "ttft_p99_s": summary.ttft_p99_s,
        "tbt_p50_s": summary.tbt_p50_s,
        "tbt_p99_s": summary.tbt_p99_s,
        "preemptions": stats.num_preemptions,
        "rotations": stats.num_rotations_out,
        "bytes_h2d": transfer.stats.bytes_h2d if transfer else 0,
        "bytes_d2h": transfer.stats.bytes_d2h if transfer else 0,
        "exposed_transfer_s": transfer.exposed_transfer_s if transfer else 0.0,
    }
    return row
