"""Putting a simulated engine together: the real :class:`Engine`, KV manager and policy, with
the model and the copies replaced by the cost model (:class:`SimulatedExecutor`,
:class:`SimulatedTransferEngine`) on one :class:`VirtualClock`.

Policies that never rotate (vllm, vllm-priority) run on an HBM-only KV manager, as vLLM V1
has no host tier; swap, edf and lvf get the DRAM tier when ``dram_kv_gib > 0``. Pools are
``gib / block bytes`` blocks (2 MiB per 16-token block for Llama-3-8B).

The worker plans locally, so every engine step first pays the policy's planning time: the
planner is wrapped in a :class:`ChargedPlanner` that advances the virtual clock by the
profile's deterministic ``costmodel.plan_time_s`` of the snapshot's size (not wall time), for
every policy. The executor asks the transfer engine how long the link copies under each
iteration's compute and charges the copy/compute interference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from data_plane.engine.engine import Engine, Planner
from data_plane.kv.tiered import KVCacheManager
from lab.costmodel import (
    CostProfile,
    auto_b_xfer_blocks,
    iteration_time_s,
    kv_block_bytes,
    plan_time_s,
)
from lab.sim.clock import VirtualClock
from lab.sim.executor import SimulatedExecutor
from lab.sim.transfer import DuplexLink, SimulatedTransferEngine, naive_link
from shared.policy import ColumnarSnapshot, Knobs, Plan, Snapshot, make_plan
from shared.policy.adaptive import controlled_knobs, residency_controller

GIB = 1 << 30
ROTATING_POLICIES = frozenset({"swap", "edf", "lvf"})
TRANSFERS = ("duplex", "naive")
PREFIX_CACHING = ("off", "hbm", "both")


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
    # Prefix caching (data_plane/kv/prefix_cache.py): "off", "hbm" (vLLM V1's cache) or "both"
    # (HBM, then the DRAM tier's eager-synced copies; a policy without DRAM gets "hbm").
    prefix_caching: str = "off"

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
        if self.prefix_caching not in PREFIX_CACHING:
            raise ValueError(
                f"prefix_caching must be one of {PREFIX_CACHING}, got {self.prefix_caching!r}"
            )

    @property
    def block_bytes(self) -> int:
        return kv_block_bytes(self.profile)

    @property
    def num_hbm_blocks(self) -> int:
        return int(self.hbm_kv_gib * GIB // self.block_bytes)

    @property
    def num_dram_blocks(self) -> int:
        return int(self.dram_kv_gib * GIB // self.block_bytes)


class ChargedPlanner:
    """``planner`` (the engine's) that first advances ``clock`` by ``plan_time_s(profile,
    len(snapshot.requests))``: the step's planning time, charged before its copies and
    compute. ``t_planned_s`` is the clock right after the last charge (the simulator's stall
    check: a step that moved the clock no further did nothing)."""

    __slots__ = ("clock", "num_calls", "plan_s", "planner", "profile", "t_planned_s")

    def __init__(self, planner: Planner, clock: VirtualClock, profile: CostProfile) -> None:
        self.planner = planner
        self.clock = clock
        self.profile = profile
        self.plan_s = 0.0  # planning time charged so far
        self.num_calls = 0
        self.t_planned_s = clock.now

    def __call__(self, snapshot: Snapshot | ColumnarSnapshot) -> Plan:
        seconds = plan_time_s(self.profile, len(snapshot.requests))
        self.clock.now += seconds
        self.plan_s += seconds
        self.num_calls += 1
        self.t_planned_s = self.clock.now
        return self.planner(snapshot)


@dataclass(slots=True)
class SimParts:
    clock: VirtualClock
    engine: Engine
    executor: SimulatedExecutor
    transfer: SimulatedTransferEngine | None
    auto_profile: CostProfile | None  # set when b_xfer is "auto"
    planner: ChargedPlanner


def build_parts(policy: str, knobs: Knobs, setup: SimSetup) -> SimParts:
    """The engine (with its KV manager, executor, transfer engine and charged planner) for one
    run."""
    profile = setup.profile
    clock = VirtualClock()
    auto_profile, b_xfer = _b_xfer(setup)
    transfer = None
    kv: KVCacheManager
    if policy in ROTATING_POLICIES and setup.num_dram_blocks > 0:
        link = DuplexLink(profile) if setup.transfer == "duplex" else naive_link(profile)
        transfer = SimulatedTransferEngine(clock, link, setup.block_bytes)
        kv = KVCacheManager(
            setup.num_hbm_blocks,
            setup.num_dram_blocks,
            profile.block_size_tokens,
            transfer,
            b_xfer_blocks=b_xfer,
            eager_sync=setup.eager_sync,
            prefix_caching=setup.prefix_caching != "off",
            dram_prefix_caching=setup.prefix_caching == "both",
        )
    else:
        caching = setup.prefix_caching != "off"
        kv = KVCacheManager.hbm_only(setup.num_hbm_blocks, profile.block_size_tokens, caching)
    executor = SimulatedExecutor(clock, profile, copies=transfer)
    plan_knobs = dataclasses.replace(knobs, policy=policy, b_xfer=None if auto_profile else b_xfer)
    controller = residency_controller(plan_knobs)

    def plan(snapshot: Snapshot | ColumnarSnapshot) -> Plan:
        snapshot, knobs_now = controlled_knobs(snapshot, plan_knobs, controller)
        return make_plan(snapshot, knobs_now)

    planner = ChargedPlanner(plan, clock, profile)
    engine = Engine(
        executor=executor,
        kv=kv,
        planner=planner,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_num_seqs=setup.max_num_seqs,
        max_model_len=setup.num_hbm_blocks * profile.block_size_tokens + 1,
        clock=clock,
        columnar=policy == "lvf",  # the columnar LVF: the same plans, numpy over the queue
    )
    return SimParts(clock, engine, executor, transfer, auto_profile, planner)


def _b_xfer(setup: SimSetup) -> tuple[CostProfile | None, int]:
    """(the profile "auto" rates the link with, or None for a fixed budget; the first
    budget): "auto" starts from one decode step's time."""
    if setup.b_xfer != "auto":
        return None, int(setup.b_xfer)
    profile, rate = setup.profile, setup.b_xfer_rate_bytes_s
    auto_profile = (
        profile
        if rate is None
        else dataclasses.replace(profile, link_h2d_bytes_s=rate, link_d2h_bytes_s=rate)
    )
    first = auto_b_xfer_blocks(auto_profile, iteration_time_s(profile, 0, 1, 0), setup.block_bytes)
    return auto_profile, first
