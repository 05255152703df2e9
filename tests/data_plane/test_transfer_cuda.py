"""CudaTransferEngine: pure segment helpers and engine logic on CPU (a stand-in for
cuda.bindings.runtime that executes copies with memmove), plus real-device tests (gpu)."""

from __future__ import annotations

import ctypes
import random
import time
from typing import Any

import numpy as np
import pytest
import torch

from data_plane.transfer.base import D2H, H2D, BlockCopy, merge_runs
from data_plane.transfer.cuda import (
    CudaTransferEngine,
    build_segments,
    check_copies,
    copy_ids,
    merge_runs_array,
)

SHAPE = (2, 1, 4, 2, 8)  # (layers, K/V, block_size, kv_heads, head_dim): 256 B per block


def _pools(n_hbm: int, n_dram: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    hbm = torch.randn(n_hbm, *SHAPE, device=device).to(torch.bfloat16)
    dram = torch.randn(n_dram, *SHAPE).to(torch.bfloat16)
    if device == "cuda":
        dram = dram.pin_memory()
    return hbm, dram


def _scattered(n: int, pool: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(pool), n)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # bitwise comparison, NaN-safe


# --- pure helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_merge_runs_array_matches_merge_runs(seed: int) -> None:
    rng = random.Random(seed)
    src = list(range(40)) + rng.sample(range(100, 400), 40)
    dst = list(range(200, 240)) + rng.sample(range(400), 40)
    pairs = list(zip(src, dst, strict=True))
    rng.shuffle(pairs)
    copies = [BlockCopy(s, d) for s, d in pairs]
    got = merge_runs_array(*copy_ids(copies))
    assert [tuple(r) for r in got.tolist()] == merge_runs(copies)


def test_merge_runs_array_edge_cases() -> None:
    assert merge_runs_array(np.array([], np.int64), np.array([], np.int64)).shape == (0, 3)
    runs = merge_runs_array(np.array([5, 3, 4, 4]), np.array([7, 0, 1, 9]))
    assert runs.tolist() == [[3, 0, 2], [4, 9, 1], [5, 7, 1]]


def test_build_segments() -> None:
    runs = np.array([[0, 3, 2], [7, 0, 1]])
    srcs, dsts, sizes = build_segments(runs, 1000, 1 << 40, 256)
    assert srcs.dtype == dsts.dtype == sizes.dtype == np.uint64
    assert srcs.tolist() == [1000, 1000 + 7 * 256]
    assert dsts.tolist() == [(1 << 40) + 3 * 256, 1 << 40]
    assert sizes.tolist() == [512, 256]
    assert [a.size for a in build_segments([], 0, 0, 256)] == [0, 0, 0]


def test_check_copies_rejects_races_and_bad_ids() -> None:
    def ids(*pairs: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        return copy_ids([BlockCopy(s, d) for s, d in pairs])

    check_copies(ids((0, 1), (1, 2)), ids((3, 4)), 8, 8)
    with pytest.raises(ValueError, match="out of range"):
        check_copies(ids((0, 8)), ids(), 8, 8)
    with pytest.raises(ValueError, match="out of range"):
        check_copies(ids(), ids((-1, 0)), 8, 8)
    with pytest.raises(ValueError, match="twice"):
        check_copies(ids((0, 1), (2, 1)), ids(), 8, 8)
    with pytest.raises(ValueError, match="an HBM block"):
        check_copies(ids((0, 1)), ids((1, 5)), 8, 8)
    with pytest.raises(ValueError, match="a DRAM block"):
        check_copies(ids((0, 1)), ids((2, 0)), 8, 8)
    check_copies(ids((0, 1)), ids((1, 5)), 8, 8, hazards=False)


def test_import_and_construct_without_cuda() -> None:
    import data_plane.transfer.cuda as mod

    assert hasattr(mod, "CudaTransferEngine")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    hbm, dram = _pools(4, 4)
    with pytest.raises(RuntimeError, match="CUDA"):
        CudaTransferEngine(hbm, dram)


# --- engine logic on CPU, through a stand-in runtime ----------------------------------------


class FakeRuntime:
    """Stream-ordered stand-in for cuda.bindings.runtime: copies are queued per stream and run
    (memmove) when an event recorded after them is synchronized. Two timing events recorded on
    one stream with copies between them are ``ELAPSED_MS`` apart."""

    ELAPSED_MS = 0.5

    def __init__(self, batch: str = "ok") -> None:
        from cuda.bindings import runtime

        self._rt = runtime
        self.batch = batch  # "ok", "ok12" (CUDA 12.8 return shape), "unsupported", "missing"
        self.streams: dict[int, list[tuple[int, int, int] | None]] = {}
        self.events: dict[int, tuple[int, int] | None] = {}
        self.timing: dict[int, bool] = {}  # event -> created without cudaEventDisableTiming
        self.elapsed_calls = 0
        self.batch_calls: list[int] = []
        self.memcpy_calls = 0

    def __getattr__(self, name: str) -> Any:  # enums, flags, structs: the real ones
        if name == "cudaMemcpyBatchAsync":
            if self.batch == "missing":
                raise AttributeError(name)
            return self._memcpy_batch
        return getattr(self._rt, name)

    def _ok(self, *values: Any) -> tuple[Any, ...]:
        return (self._rt.cudaError_t.cudaSuccess, *values)

    def cudaSetDevice(self, device: int) -> tuple[Any, ...]:
        return self._ok()

    def cudaDriverGetVersion(self) -> tuple[Any, ...]:
        return self._ok(13000)

    def cudaStreamCreateWithFlags(self, flags: int) -> tuple[Any, ...]:
        handle = 100 + len(self.streams)
        self.streams[handle] = []
        return self._ok(handle)

    def cudaStreamDestroy(self, stream: int) -> tuple[Any, ...]:
        return self._ok()

    def cudaEventCreateWithFlags(self, flags: int) -> tuple[Any, ...]:
        handle = 1000 + len(self.events)
        self.events[handle] = None
        self.timing[handle] = not int(flags) & int(self._rt.cudaEventDisableTiming)
        return self._ok(handle)

    def cudaEventElapsedTime(self, start: int, end: int) -> tuple[Any, ...]:
        self.elapsed_calls += 1
        if not (self.timing[start] and self.timing[end]):
            return (self._rt.cudaError_t.cudaErrorInvalidResourceHandle,)
        if self._pending(start) or self._pending(end):
            return (self._rt.cudaError_t.cudaErrorNotReady,)
        first, last = self.events[start], self.events[end]
        assert first is not None and last is not None, "both events must be recorded"
        assert first[0] == last[0] and first[1] < last[1], "start must precede the copies"
        return self._ok(self.ELAPSED_MS)

    def cudaEventDestroy(self, event: int) -> tuple[Any, ...]:
        return self._ok()

    def cudaEventRecord(self, event: int, stream: int) -> tuple[Any, ...]:
        self.events[event] = (stream, len(self.streams[stream]))
        return self._ok()

    def cudaStreamWaitEvent(self, stream: int, event: int, flags: int) -> tuple[Any, ...]:
        return self._ok()

    def _pending(self, event: int) -> bool:
        stream, pos = self.events[event] or (None, 0)
        return stream is not None and any(op is not None for op in self.streams[stream][:pos])

    def cudaEventQuery(self, event: int) -> tuple[Any, ...]:
        if self._pending(event):
            return (self._rt.cudaError_t.cudaErrorNotReady,)
        return self._ok()

    def cudaEventSynchronize(self, event: int) -> tuple[Any, ...]:
        stream, pos = self.events[event] or (None, 0)
        if stream is not None:
            ops = self.streams[stream]
            for i, op in enumerate(ops[:pos]):
                if op is not None:
                    ctypes.memmove(op[0], op[1], op[2])
                    ops[i] = None
        return self._ok()

    def _memcpy_batch(
        self,
        dsts: list[int],
        srcs: list[int],
        sizes: list[int],
        count: int,
        attrs: list[Any],
        idxs: list[int],
        n: int,
        stream: int,
    ) -> tuple[Any, ...]:
        if self.batch == "unsupported":
            return (self._rt.cudaError_t.cudaErrorNotSupported,)
        assert len(dsts) == len(srcs) == len(sizes) == count and idxs == [0] and n == 1
        assert attrs[0].srcAccessOrder == self._rt.cudaMemcpySrcAccessOrder(1)
        self.batch_calls.append(count)
        self.streams[stream].extend(zip(dsts, srcs, sizes, strict=True))
        return self._ok(0) if self.batch == "ok12" else self._ok()

    def cudaMemcpyAsync(
        self, dst: int, src: int, size: int, kind: Any, stream: int
    ) -> tuple[Any, ...]:
        self.memcpy_calls += 1
        self.streams[stream].append((dst, src, size))
        return self._ok()


def _fake(batch: str) -> FakeRuntime:
    pytest.importorskip("cuda.bindings.runtime")
    return FakeRuntime(batch)


def _round_trip_case() -> tuple[list[BlockCopy], list[BlockCopy]]:
    hbm_ids = _scattered(48, 64, seed=1)  # 24 H2D destinations, 24 D2H sources, disjoint
    dram_ids = _scattered(48, 64, seed=2)
    h2d = [BlockCopy(s, d) for s, d in zip(dram_ids[:24], hbm_ids[:24], strict=True)]
    d2h = [BlockCopy(s, d) for s, d in zip(hbm_ids[24:], dram_ids[24:], strict=True)]
    return h2d, d2h


@pytest.mark.parametrize("batch", ["ok", "ok12", "unsupported"])
def test_engine_logic_with_stand_in_runtime(batch: str) -> None:
    rt = _fake(batch)
    hbm, dram = _pools(64, 64)
    hbm0, dram0 = hbm.clone(), dram.clone()
    engine = CudaTransferEngine(hbm, dram, order_after_current_stream=False, runtime=rt)
    h2d, d2h = _round_trip_case()
    h, d = engine.submit(h2d, d2h)
    assert h is not None and d is not None
    assert not h.done() and not d.done()  # nothing ran yet: the fake runs on synchronize
    h.wait()
    d.wait()
    assert h.done() and d.done()
    for c in h2d:
        assert torch.equal(_bits(hbm[c.dst]), _bits(dram0[c.src]))
    for c in d2h:
        assert torch.equal(_bits(dram[c.dst]), _bits(hbm0[c.src]))
    batched = batch != "unsupported"
    assert engine.stats.batched is batched
    assert engine.stats.num_copy_calls == (2 if batched else engine.stats.num_segments)
    assert engine.stats.bytes_h2d == 24 * engine.block_bytes == engine.stats.bytes_d2h
    engine.close()


def test_engine_merges_adjacent_blocks_and_skips_empty_direction() -> None:
    rt = _fake("ok")
    hbm, dram = _pools(32, 32)
    dram0 = dram.clone()
    engine = CudaTransferEngine(hbm, dram, order_after_current_stream=False, runtime=rt)
    copies = [BlockCopy(10 + i, 20 + i) for i in range(6)] + [BlockCopy(2, 0), BlockCopy(3, 5)]
    h, d = engine.submit(copies[::-1], [])
    assert d is None and h is not None
    assert rt.batch_calls == [3] and sorted(engine.stats.last_segments) == [1, 1, 6]
    h.wait()
    assert torch.equal(_bits(hbm[20:26]), _bits(dram0[10:16]))
    assert engine.submit([], []) == (None, None)
    with pytest.raises(ValueError, match="an HBM block"):
        engine.submit([BlockCopy(0, 1)], [BlockCopy(1, 0)])


def test_engine_falls_back_without_batch_api() -> None:
    rt = _fake("missing")
    hbm, dram = _pools(16, 16)
    engine = CudaTransferEngine(hbm, dram, order_after_current_stream=False, runtime=rt)
    assert engine.batched is False
    h, _ = engine.submit([BlockCopy(0, 3), BlockCopy(5, 9)], [])
    assert h is not None
    h.wait()
    assert rt.memcpy_calls == 2 and engine.stats.num_copy_calls == 2
    assert torch.equal(_bits(hbm[9]), _bits(dram[5]))


def test_engine_times_each_batch_with_events() -> None:
    rt = _fake("ok")
    hbm, dram = _pools(64, 64)
    engine = CudaTransferEngine(hbm, dram, order_after_current_stream=False, runtime=rt)
    assert engine.link_bytes_per_s == 0.0
    h, d = engine.submit(*_round_trip_case())
    assert h is not None and d is not None
    assert not h.done() and engine.meter.num_batches == 0  # timed once seen done, not before
    h.wait()
    d.wait()
    assert h.done() and d.done()
    assert rt.elapsed_calls == 2 and engine.meter.num_batches == 2  # once per handle
    expected = 24 * engine.block_bytes / (FakeRuntime.ELAPSED_MS / 1e3)
    assert engine.meter.bytes_per_s(H2D) == pytest.approx(expected)
    assert engine.meter.bytes_per_s(D2H) == pytest.approx(expected)
    assert engine.link_bytes_per_s == pytest.approx(expected)
    engine.close()


def test_engine_without_link_measurement_makes_no_timing_events() -> None:
    rt = _fake("ok")
    hbm, dram = _pools(16, 16)
    engine = CudaTransferEngine(
        hbm, dram, order_after_current_stream=False, measure_link=False, runtime=rt
    )
    h, _ = engine.submit([BlockCopy(0, 3)], [])
    assert h is not None
    h.wait()
    assert not any(rt.timing.values()) and rt.elapsed_calls == 0
    assert engine.link_bytes_per_s == 0.0


# --- real device ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_round_trip_scattered_duplex() -> None:
    hbm, dram = _pools(256, 256, device="cuda")
    hbm0, dram0 = hbm.cpu(), dram.clone()
    engine = CudaTransferEngine(hbm, dram)
    hbm_ids, dram_ids = _scattered(200, 256, seed=3), _scattered(200, 256, seed=4)
    h2d = [BlockCopy(s, d) for s, d in zip(dram_ids[:100], hbm_ids[:100], strict=True)]
    d2h = [BlockCopy(s, d) for s, d in zip(hbm_ids[100:], dram_ids[100:], strict=True)]
    h, d = engine.submit(h2d, d2h)
    assert h is not None and d is not None
    h.wait()
    d.wait()
    assert h.done() and d.done()
    assert engine.stats.num_copy_calls == (2 if engine.batched else engine.stats.num_segments)
    for c in h2d:
        assert torch.equal(_bits(hbm[c.dst].cpu()), _bits(dram0[c.src]))
    for c in d2h:
        assert torch.equal(_bits(dram[c.dst]), _bits(hbm0[c.src]))
    engine.close()


@pytest.mark.gpu
def test_cuda_merges_runs_and_round_trips() -> None:
    hbm, dram = _pools(64, 64, device="cuda")
    dram0 = dram.clone()
    engine = CudaTransferEngine(hbm, dram)
    h, _ = engine.submit([BlockCopy(i, 32 + i) for i in range(16)], [])  # one 16-block run
    assert h is not None and engine.stats.last_segments == [16]
    h.wait()
    _, d = engine.submit([], [BlockCopy(32 + i, 48 + i) for i in range(16)])
    assert d is not None
    while not d.done():
        pass
    assert torch.equal(_bits(dram[48:64]), _bits(dram0[0:16]))  # DRAM -> HBM -> DRAM
    engine.close()


@pytest.mark.gpu
def test_cuda_orders_after_current_stream() -> None:
    hbm, dram = _pools(8, 8, device="cuda")
    engine = CudaTransferEngine(hbm, dram)
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        x = x @ x  # keep the current stream busy
    hbm[1].fill_(3.0)  # queued behind the matmuls; the D2H below must see it
    _, d = engine.submit([], [BlockCopy(1, 2)])
    assert d is not None
    d.wait()
    assert torch.all(dram[2] == 3.0)
    engine.close()


@pytest.mark.gpu
def test_cuda_measures_link_bandwidth() -> None:
    block = (4, 2, 16, 8, 128)  # 256 KiB per bf16 block
    hbm = torch.zeros(512, *block, device="cuda", dtype=torch.bfloat16)
    dram = torch.zeros(512, *block, dtype=torch.bfloat16).pin_memory()
    engine = CudaTransferEngine(hbm, dram)
    assert engine.link_bytes_per_s == 0.0
    ids = _scattered(512, 512, seed=5)
    h2d = [BlockCopy(s, d) for s, d in zip(ids[:256], ids[:256], strict=True)]
    d2h = [BlockCopy(s, d) for s, d in zip(ids[256:], ids[256:], strict=True)]
    num_bytes = 256 * engine.block_bytes  # 64 MiB each way
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    h, d = engine.submit(h2d, d2h)
    assert h is not None and d is not None
    while not h.done():  # one handle seen done by polling, the other by waiting
        pass
    d.wait()
    elapsed = time.perf_counter() - t0
    rates = engine.meter.bytes_per_s(H2D), engine.meter.bytes_per_s(D2H)
    print(f"measured H2D {rates[0] / 1e9:.1f} GB/s, D2H {rates[1] / 1e9:.1f} GB/s")
    for rate in rates:  # device busy time within the host's wall time; below 10 TB/s
        assert num_bytes / elapsed <= rate < 1e13
    assert engine.link_bytes_per_s == min(rates)
    engine.close()
