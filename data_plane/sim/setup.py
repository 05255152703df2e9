"""Putting a simulated engine together: the real :class:`Engine`, KV manager and policy, with
the model and the copies replaced by the cost model (:class:`SimulatedExecutor`,
:class:`SimulatedTransferEngine`) on one :class:`VirtualClock`.

Policies that never rotate (vllm, vllm-priority) run on an HBM-only KV manager, as vLLM V1
has no host tier; swap, edf and lvf get the DRAM tier when ``dram_kv_gib > 0``. Pools are
``gib / block bytes`` blocks (2 MiB per 16-token block for Llama-3-8B).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from data_plane.engine.engine import Engine
from data_plane.kv.manager import KVCacheManager
from data_plane.kv.tiered import TieredKVCacheManager
from data_plane.sim.clock import VirtualClock
from data_plane.sim.executor import SimulatedExecutor
from data_plane.sim.transfer import DuplexLink, SimulatedTransferEngine, naive_link
from shared.costmodel import CostProfile, auto_b_xfer_blocks, iteration_time_s, kv_block_bytes
from shared.policy import Knobs, make_plan

GIB = 1 << 30
ROTATING_POLICIES = frozenset({"swap", "edf", "lvf"})
TRANSFERS = ("duplex", "naive")


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
class SimParts:
    clock: VirtualClock
    engine: Engine
    executor: SimulatedExecutor
    transfer: SimulatedTransferEngine | None
    auto_profile: CostProfile | None  # set when b_xfer is "auto"


def build_parts(policy: str, knobs: Knobs, setup: SimSetup) -> SimParts:
    """The engine (with its KV manager, executor and transfer engine) for one run."""
    profile = setup.profile
    clock = VirtualClock()
    executor = SimulatedExecutor(clock, profile)
    auto_profile = None
    if setup.b_xfer == "auto":
        rate = setup.b_xfer_rate_bytes_s
        auto_profile = (
            profile
            if rate is None
            else dataclasses.replace(profile, link_h2d_bytes_s=rate, link_d2h_bytes_s=rate)
        )
        b_xfer = auto_b_xfer_blocks(
            auto_profile, iteration_time_s(profile, 0, 1, 0), setup.block_bytes
        )
    else:
        b_xfer = int(setup.b_xfer)
    transfer = None
    kv: KVCacheManager
    if policy in ROTATING_POLICIES and setup.num_dram_blocks > 0:
        link = DuplexLink(profile) if setup.transfer == "duplex" else naive_link(profile)
        transfer = SimulatedTransferEngine(clock, link, setup.block_bytes)
        kv = TieredKVCacheManager(
            setup.num_hbm_blocks,
            setup.num_dram_blocks,
            profile.block_size_tokens,
            transfer,
            b_xfer_blocks=b_xfer,
            eager_sync=setup.eager_sync,
        )
    else:
        kv = KVCacheManager(setup.num_hbm_blocks, profile.block_size_tokens)
    plan_knobs = dataclasses.replace(knobs, policy=policy, b_xfer=None if auto_profile else b_xfer)
    engine = Engine(
        executor=executor,
        kv=kv,
        planner=lambda snapshot: make_plan(snapshot, plan_knobs),
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_num_seqs=setup.max_num_seqs,
        max_model_len=setup.num_hbm_blocks * profile.block_size_tokens + 1,
        clock=clock,
        columnar=policy == "lvf",  # the columnar LVF: the same plans, numpy over the queue
    )
    return SimParts(clock, engine, executor, transfer, auto_profile)
