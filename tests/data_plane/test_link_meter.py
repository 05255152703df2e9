"""Measured link bandwidth for ``B_xfer=auto``: the LinkMeter, the cpu and naive engines timing
their real copies, the tiered KV manager exposing the rate, and the worker's local budget."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from data_plane.kv.tiered import KVCacheManager
from data_plane.service import Worker
from data_plane.transfer.base import D2H, H2D, BlockCopy, LinkMeter, TransferEngine
from data_plane.transfer.cpu import CpuTransferEngine
from data_plane.transfer.naive import NaiveTransferEngine
from shared.b_xfer import b_xfer_blocks_at_rate, measured_b_xfer_blocks
from shared.policy import Knobs

SHAPE = (4, 2, 16, 4, 64)  # (layers, K/V, block_size, kv_heads, head_dim): 128 KiB per block
NUM_BLOCKS = 64


def _pools() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(NUM_BLOCKS, *SHAPE), torch.randn(NUM_BLOCKS, *SHAPE)


def _copies(n: int) -> tuple[list[BlockCopy], list[BlockCopy]]:
    """``n`` H2D and ``n`` D2H copies on disjoint blocks, scattered (no merged run)."""
    h2d = [BlockCopy(2 * i, 2 * i) for i in range(n)]
    d2h = [BlockCopy(2 * i + 1, 2 * i + 1) for i in range(n)]
    return h2d, d2h


# --- LinkMeter ------------------------------------------------------------------------------


def test_meter_is_zero_until_a_batch_is_recorded() -> None:
    meter = LinkMeter()
    assert meter.bytes_per_s(H2D) == meter.bytes_per_s(D2H) == meter.link_bytes_per_s == 0.0
    meter.record(H2D, 0, 1.0)  # nothing moved
    meter.record(H2D, 100, 0.0)  # no duration
    meter.record(H2D, 100, float("nan"))
    assert meter.link_bytes_per_s == 0.0 and meter.num_batches == 0


def test_meter_weights_by_bytes_and_takes_the_slower_direction() -> None:
    meter = LinkMeter()
    meter.record(H2D, 1_000_000, 0.001)
    meter.record(H2D, 1_000, 0.001)  # a tiny latency-bound batch: sum/sum, not mean of rates
    assert meter.bytes_per_s(H2D) == pytest.approx(1_001_000 / 0.002)
    assert meter.link_bytes_per_s == meter.bytes_per_s(H2D)  # D2H unmeasured: not a zero
    meter.record(D2H, 1_000_000, 0.004)
    assert meter.link_bytes_per_s == pytest.approx(2.5e8)
    with pytest.raises(ValueError, match="direction"):
        meter.record("sideways", 1, 1.0)
    with pytest.raises(ValueError, match="direction"):
        meter.bytes_per_s("sideways")


def test_meter_is_not_dragged_down_by_stalled_batches() -> None:
    """Batches of 5-12 blocks of 20 KB at 2.5 GB/s, one in ten stalled for 4 ms (the copy
    thread waiting for the GIL): the rate is the batches' (the sum over the window said
    0.25 GB/s, so B_xfer was a handful of blocks where the link moves a hundred)."""
    meter = LinkMeter()
    block_bytes, bandwidth = 20_480, 2.5e9
    for i in range(40):
        n = 5 + i % 8
        meter.record(
            H2D, n * block_bytes, n * block_bytes / bandwidth + (0.004 if i % 10 == 0 else 0)
        )
    assert meter.bytes_per_s(H2D) == pytest.approx(bandwidth)
    few = LinkMeter()  # too few batches for a median: the ratio
    few.record(H2D, block_bytes, 0.001)
    few.record(H2D, 3 * block_bytes, 0.001)
    assert few.bytes_per_s(H2D) == pytest.approx(4 * block_bytes / 0.002)


def test_meter_window_forgets_old_batches() -> None:
    meter = LinkMeter(window=4)
    meter.record(H2D, 1_000, 1.0)  # slow, then pushed out by four fast batches
    for _ in range(4):
        meter.record(H2D, 1_000, 0.001)
    assert meter.bytes_per_s(H2D) == pytest.approx(1e6)
    with pytest.raises(ValueError):
        LinkMeter(window=0)


# --- real copies ------------------------------------------------------------------------------


@pytest.mark.parametrize("engine_cls", [CpuTransferEngine, NaiveTransferEngine])
def test_engine_measures_its_copies(engine_cls: type[TransferEngine]) -> None:
    hbm, dram = _pools()
    engine = engine_cls(hbm, dram)
    assert engine.link_bytes_per_s == 0.0  # nothing copied yet
    h2d, d2h = _copies(16)
    num_bytes = 16 * engine.block_bytes
    t0 = time.perf_counter()
    h, d = engine.submit(h2d, d2h)
    assert h is not None and d is not None
    h.wait()
    d.wait()
    elapsed = time.perf_counter() - t0
    engine.close()
    rate_h2d, rate_d2h = engine.meter.bytes_per_s(H2D), engine.meter.bytes_per_s(D2H)
    # The meter's busy time lies inside the test's wall time around submit..wait, so its rate
    # is at least bytes / elapsed; and no host copies 16 x 128 KiB in under a microsecond.
    for rate in (rate_h2d, rate_d2h):
        assert num_bytes / elapsed <= rate < num_bytes / 1e-6
    assert engine.link_bytes_per_s == min(rate_h2d, rate_d2h)
    assert engine.meter.num_batches == 2
    assert torch.equal(hbm[0], dram[0]) and torch.equal(dram[1], hbm[1])


def test_one_direction_measured_alone() -> None:
    hbm, dram = _pools()
    engine = CpuTransferEngine(hbm, dram)
    h, _ = engine.submit(_copies(8)[0], [])
    assert h is not None
    h.wait()
    engine.close()
    assert engine.meter.bytes_per_s(D2H) == 0.0
    assert engine.link_bytes_per_s == engine.meter.bytes_per_s(H2D) > 0


def test_the_simulators_engine_reports_no_measured_link() -> None:
    """It measures nothing (virtual time, a known link model): it says so itself, 0.0."""
    from lab.costmodel import load_profile
    from lab.sim.clock import VirtualClock
    from lab.sim.transfer import DuplexLink, SimulatedTransferEngine

    link = DuplexLink(load_profile("h200-llama3-8b"))
    engine = SimulatedTransferEngine(VirtualClock(), link, 2 << 20)
    engine.submit([BlockCopy(0, 0)], [])
    assert engine.link_bytes_per_s == 0.0


def test_tiered_kv_exposes_the_measured_rate() -> None:
    hbm, dram = _pools()
    kv = KVCacheManager(NUM_BLOCKS, NUM_BLOCKS, 16, CpuTransferEngine(hbm, dram), 32)
    assert kv.link_bytes_per_s == 0.0
    assert kv.ensure_hbm("r", 0, 16 * 6) is not None  # six full blocks
    kv.on_computed("r", 16 * 6)  # queued for eager sync (D2H)
    kv.issue_transfers()
    kv.drain()
    assert kv.tiered_stats.blocks_synced == 6
    assert kv.transfer is not None
    assert kv.link_bytes_per_s == kv.transfer.meter.bytes_per_s(D2H) > 0
    kv.close()
    no_meter = KVCacheManager.hbm_only(8, 16)  # no link: nothing measured
    assert no_meter.link_bytes_per_s == 0.0


# --- B_xfer=auto from a measured rate ---------------------------------------------------------


def test_measured_b_xfer_blocks() -> None:
    assert measured_b_xfer_blocks(1e9, 0.01, 1_000_000, 64) == 10
    assert measured_b_xfer_blocks(1.5e9, 0.01, 1_000_000, 64) == 15  # floor of 15.000...
    assert measured_b_xfer_blocks(1e9, 0.0, 1_000_000, 64) == 1  # at least one block
    assert measured_b_xfer_blocks(0.0, 0.01, 1_000_000, 64) == 64  # unmeasured: unchanged
    assert measured_b_xfer_blocks(1e9, 0.01, 0, 64) == 64  # block size unknown: unchanged
    assert b_xfer_blocks_at_rate(4e10, 0.1, 1_500_000) == 2666
    for bad in ((float("inf"), 0.1, 1), (-1.0, 0.1, 1), (1.0, float("nan"), 1), (1.0, 0.1, 0)):
        with pytest.raises(ValueError):
            b_xfer_blocks_at_rate(*bad)


def _worker(kv: KVCacheManager, remote_budget: int | None, b_xfer: int | None) -> SimpleNamespace:
    """What Worker._set_b_xfer reads: the engine, the planner's plan for the next step (a
    remote one carrying ``remote_budget``, or none: local) and the last iteration's time."""
    remote = None if remote_budget is None else SimpleNamespace(b_xfer_blocks=remote_budget)
    return SimpleNamespace(
        engine=SimpleNamespace(kv=kv, stats=SimpleNamespace(num_iterations=7)),
        planner=SimpleNamespace(remote_for=lambda _: remote, knobs=Knobs(b_xfer=b_xfer)),
        block_bytes=kv.transfer.block_bytes if kv.transfer is not None else 0,
        _iteration_time_s=0.01,
    )


def test_worker_planning_locally_with_auto_uses_the_measured_rate() -> None:
    hbm, dram = _pools()
    kv = KVCacheManager(NUM_BLOCKS, NUM_BLOCKS, 16, CpuTransferEngine(hbm, dram), 64)
    assert kv.transfer is not None
    block_bytes = kv.transfer.block_bytes
    Worker._set_b_xfer(_worker(kv, None, None))  # type: ignore[arg-type]
    assert kv.b_xfer_blocks == 64  # nothing measured yet: keeps its budget
    kv.transfer.meter.record(H2D, 1000 * block_bytes, 0.1)  # 10,000 blocks/s
    kv.transfer.meter.record(D2H, 1000 * block_bytes, 0.2)  # 5,000 blocks/s: the slower
    Worker._set_b_xfer(_worker(kv, 77, None))  # type: ignore[arg-type]
    assert kv.b_xfer_blocks == 77  # a fresh remote plan carries its own budget
    Worker._set_b_xfer(_worker(kv, None, 300))  # type: ignore[arg-type]
    assert kv.b_xfer_blocks == 300  # planning locally with a fixed knob: the knob
    kv.b_xfer_blocks = 64
    Worker._set_b_xfer(_worker(kv, None, None))  # type: ignore[arg-type]
    assert (
        kv.b_xfer_blocks == 50 == measured_b_xfer_blocks(kv.link_bytes_per_s, 0.01, block_bytes, 64)
    )
    kv.close()
