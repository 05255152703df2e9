"""Run the real engine, KV managers and policies over a request trace in virtual time.

Nothing is faked above the executor and the transfer engine: :class:`Engine` plans with
``shared.policy.make_plan``, the :class:`KVCacheManager` does DuplexKV's bookkeeping
(eager sync, rotate out/in, the ``b_xfer_blocks`` budget), and only the model
(:class:`SimulatedExecutor`) and the copies (:class:`SimulatedTransferEngine`) are replaced by
the cost model. Every step first pays the policy's planning time on the virtual clock
(``setup.ChargedPlanner``). Requests enter at their arrival times; when the engine has nothing
to do the clock jumps to the next arrival. Every output token is stamped with the virtual time
at the end of the iteration that produced it; ``lab.metrics`` turns those timelines into a row.
A run may stop at a virtual-time horizon (an overloaded or thrashing run can take very long to
drain): requests not finished by then are aborted (their blocks come back) and count as
unfinished (TPOT and goodput misses).

The engine and its parts are put together by :func:`lab.sim.setup.build_parts`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from data_plane.engine.request import RequestError
from data_plane.engine.sampling import SamplingParams
from lab.costmodel import CostProfile, auto_b_xfer_blocks
from lab.metrics import ROW_KEYS as ROW_KEYS  # the row's keys, shared with `superinfer bench`
from lab.metrics import RequestTimeline, slo_fields, summarize
from lab.sim.setup import SimParts, SimSetup, build_parts
from lab.traces import TraceRequest
from shared.policy import POLICY_NAMES, Knobs

STALL_TICK_S = 0.01  # idle step with nothing in flight and no arrival left: let time pass
MAX_STALL_S = 60.0  # ... for this long, then the run is stuck (a policy that never schedules)
ProgressFn = Callable[[int, int], None]


class SimulationStuck(RuntimeError):
    """The engine made no progress for MAX_STALL_S of virtual time with nothing left to arrive."""


@dataclass(slots=True)
class SimResult:
    row: dict[str, Any]
    timelines: list[RequestTimeline]
    num_clipped: int = 0  # requests shortened to fit the whole HBM pool
    num_unfinished: int = 0  # not done at the horizon (including never injected)
    num_rejected: int = 0  # requests the engine refused (count as SLO misses)
    num_iterations: int = 0
    num_stalls: int = 0
    virtual_s: float = 0.0
    busy_s: float = 0.0  # virtual seconds spent computing (copy interference included)
    interference_s: float = 0.0  # of busy_s: the slowdown from KV copies under the compute
    plan_s: float = 0.0  # virtual seconds charged for planning (every step)
    wall_s: float = 0.0
    max_blocks_per_iteration: int = 0
    leaked_hbm_blocks: int = 0
    leaked_dram_blocks: int = 0
    b_xfer_history: list[int] = field(default_factory=list)  # sampled every 64 iterations
    # Prefix caching: prompt tokens looked up, the fraction found per tier (not row keys: a
    # row has the keys `superinfer bench` rows have).
    prefix: dict[str, Any] = field(default_factory=dict)


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
    setup = SimSetup(
        profile,
        hbm_kv_gib,
        dram_kv_gib,
        b_xfer,
        max_num_batched_tokens,
        max_num_seqs,
        transfer,
        eager_sync,
    )
    return run_simulation(trace_requests, policy, knobs, setup, rps=rps).row


def run_simulation(
    trace_requests: Sequence[TraceRequest],
    policy: str,
    knobs: Knobs,
    setup: SimSetup,
    rps: float | None = None,
    on_progress: ProgressFn | None = None,
    horizon_s: float | None = None,
) -> SimResult:
    """:func:`simulate` with the details (timelines, counters, leaks, wall time); stops at
    virtual time ``horizon_s`` when given (see the module docstring)."""
    if policy not in POLICY_NAMES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICY_NAMES)}")
    t0 = time.perf_counter()
    trace = sorted(trace_requests, key=lambda r: r.arrival_s)
    parts = build_parts(policy, knobs, setup)
    result = SimResult(row={}, timelines=[])
    times, num_injected = _run(parts, trace, result, on_progress, horizon_s)
    unfinished = _abort_unfinished(parts, num_injected, len(trace))
    result.num_unfinished = len(unfinished)
    _finish(parts, result)
    result.timelines = [
        RequestTimeline(
            r.arrival_s,
            t,
            knobs.slo_ttft_s if r.slo_ttft_s is None else r.slo_ttft_s,
            knobs.slo_tbt_s if r.slo_tbt_s is None else r.slo_tbt_s,
            i not in unfinished,
            r.tenant,
        )
        for i, (r, t) in enumerate(zip(trace, times, strict=True))
    ]
    result.row = _row(policy, rps, trace, parts, result)
    result.prefix = prefix_fields(parts)
    result.wall_s = time.perf_counter() - t0
    return result


def _fit(request: TraceRequest, capacity_tokens: int) -> tuple[int, int]:
    """(prompt, output) lengths shortened so the request's KV fits the whole HBM pool: the
    output first, then the prompt (a request larger than HBM could never run)."""
    prompt = min(request.input_len, capacity_tokens - 1)
    output = max(1, min(request.output_len, capacity_tokens - prompt))
    return prompt, output


HASH_BLOCK_TOKENS = 512  # Mooncake's hash_ids name blocks of this many tokens
_UNIQUE_BASE = 1 << 40  # token ids above every hash-derived one


def prompt_tokens(index: int, request: TraceRequest, num_tokens: int) -> list[int]:
    """The ``index``-th request's prompt for the simulator (only equality matters there, for
    prefix caching): each of the trace's 512-token ``hash_ids`` blocks becomes tokens that
    depend on the id alone, so requests sharing ids share a prefix; the rest, and every prompt
    of a trace without hash ids, is unique to the request."""
    if request.session is not None:  # a conversation: the system prompt, then its stream
        system = min(request.system_len, num_tokens)
        stream = _UNIQUE_BASE * (request.session + 1)
        return list(range(system)) + list(range(stream + system, stream + num_tokens))
    tokens = [
        h * HASH_BLOCK_TOKENS + k for h in request.hash_ids for k in range(HASH_BLOCK_TOKENS)
    ][:num_tokens]
    base = _UNIQUE_BASE * (index + 1) + (1 << 62)  # apart from the sessions' streams
    tokens.extend(range(base + len(tokens), base + num_tokens))
    return tokens


def _inject(parts: SimParts, index: int, request: TraceRequest, result: SimResult) -> None:
    engine = parts.engine
    capacity = engine.kv.num_hbm_blocks * engine.kv.block_size
    prompt, output = _fit(request, capacity)
    if (prompt, output) != (request.input_len, request.output_len):
        result.num_clipped += 1
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    tokens = prompt_tokens(index, request, prompt)
    try:
        engine.add_request(
            f"r{index}",
            tokens,
            params,
            t_arr_s=request.arrival_s,
            tenant=request.tenant,
            slo_ttft_s=request.slo_ttft_s,
            slo_tbt_s=request.slo_tbt_s,
        )
    except RequestError:
        result.num_rejected += 1


def _run(
    parts: SimParts,
    trace: list[TraceRequest],
    result: SimResult,
    on_progress: ProgressFn | None,
    horizon_s: float | None,
) -> tuple[list[list[float]], int]:
    clock, engine, executor = parts.clock, parts.engine, parts.executor
    times: list[list[float]] = [[] for _ in trace]
    by_id = {f"r{i}": t for i, t in enumerate(times)}
    nxt, n = 0, len(trace)
    stalled_s = 0.0
    num_done = 0
    horizon = float("inf") if horizon_s is None else horizon_s
    while (nxt < n or engine.has_unfinished()) and clock.now < horizon:
        while nxt < n and trace[nxt].arrival_s <= clock.now:
            _inject(parts, nxt, trace[nxt], result)
            nxt += 1
        if not engine.has_unfinished():
            if nxt < n:
                clock.now = trace[nxt].arrival_s
            continue
        iters_before = executor.num_iterations
        outputs = engine.step().outputs
        now = clock.now
        for out in outputs:
            by_id[out.request_id].extend([now] * len(out.new_token_ids))
            num_done += out.finish_reason is not None
        if executor.num_iterations != iters_before:
            stalled_s = 0.0
            _update_b_xfer(parts, result)
        elif now == parts.planner.t_planned_s:  # planned, then neither computed nor waited
            stalled_s = _stall(parts, trace, nxt, stalled_s, result)
        if on_progress is not None and engine.stats.num_iterations % 256 == 0:
            on_progress(num_done, n)
    if on_progress is not None:
        on_progress(num_done, n)
    return times, nxt


def _update_b_xfer(parts: SimParts, result: SimResult) -> None:
    kv = parts.engine.kv
    if parts.auto_profile is not None and parts.transfer is not None:
        kv.set_b_xfer_blocks(
            auto_b_xfer_blocks(
                parts.auto_profile, parts.executor.last_iteration_s, parts.transfer.block_bytes
            )
        )
    if parts.executor.num_iterations % 64 == 0:
        result.b_xfer_history.append(kv.b_xfer_blocks)


def _stall(
    parts: SimParts, trace: list[TraceRequest], nxt: int, stalled_s: float, result: SimResult
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
            f"{len(engine.rotary)} rotary, {engine.kv.num_free_hbm_blocks} free HBM blocks"
        )
    return stalled_s


def _abort_unfinished(parts: SimParts, num_injected: int, num_requests: int) -> set[int]:
    """Indices of the requests not finished at the horizon (the engine's are aborted, which
    frees their blocks in every tier) or never injected."""
    engine = parts.engine
    unfinished = {int(request_id[1:]) for request_id in engine.requests}
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return unfinished | set(range(num_injected, num_requests))


def _finish(parts: SimParts, result: SimResult) -> None:
    """Counters, then drain the copies still in flight (after the last token, so they do not
    count as exposed) and check that every block came back."""
    kv = parts.engine.kv
    result.num_iterations = parts.executor.num_iterations
    result.virtual_s = parts.clock.now
    result.busy_s = parts.executor.busy_s
    result.interference_s = parts.executor.interference_s
    result.plan_s = parts.planner.plan_s
    exposed = parts.transfer.exposed_transfer_s if parts.transfer else 0.0
    result.max_blocks_per_iteration = kv.tiered_stats.max_blocks_per_iteration
    kv.drain()
    if parts.transfer is not None:
        parts.transfer.exposed_transfer_s = exposed
    stats = kv.stats()
    result.leaked_hbm_blocks = stats.num_hbm_blocks - stats.num_free_hbm_blocks
    result.leaked_dram_blocks = stats.num_dram_blocks - stats.num_free_dram_blocks


def _row(
    policy: str,
    rps: float | None,
    trace: list[TraceRequest],
    parts: SimParts,
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
        **slo_fields(summary),
        "preemptions": stats.num_preemptions,
        "rotations": stats.num_rotations_out,
        "bytes_h2d": transfer.stats.bytes_h2d if transfer else 0,
        "bytes_d2h": transfer.stats.bytes_d2h if transfer else 0,
        "exposed_transfer_s": transfer.exposed_transfer_s if transfer else 0.0,
    }
    return row


def prefix_fields(parts: SimParts) -> dict[str, Any]:
    """Prompt tokens looked up in the prefix caches at admission and the fraction found per
    tier (0 with caching off)."""
    counters = parts.engine.kv.prefix_counters
    queried = max(1, counters.num_queried_tokens)
    return {
        "prefix_queried_tokens": counters.num_queried_tokens,
        "prefix_hbm_hit_frac": counters.num_hbm_hit_tokens / queried,
        "prefix_dram_hit_frac": counters.num_dram_hit_tokens / queried,
    }
