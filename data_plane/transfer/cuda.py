"""DuplexKV on a CUDA device: one ``cudaMemcpyBatchAsync`` per direction per submit.

H2D copies run on one non-blocking stream and D2H copies on another, so both directions of a
submit overlap on the two copy engines. Adjacent block ids are merged into larger segments first
(:func:`merge_runs_array`, the vectorised twin of :func:`merge_runs`), and the pointer arrays are
computed with numpy (:func:`build_segments`; both in ``segments.py``). Completion is a CUDA event
recorded on the stream after the batch; a second event recorded before it times the batch on the
device: when the handle is first seen done, ``cudaEventElapsedTime`` between the two (the batch's
time on its copy stream, from the moment the stream reached it) goes with its bytes to the
engine's :class:`~data_plane.transfer.base.LinkMeter`. Without ``cudaMemcpyBatchAsync`` (driver
< 12.8, old cuda-python) the engine falls back to one ``cudaMemcpyAsync`` per merged segment and
says so in ``stats.batched``.

Importing this module makes no CUDA call; constructing the engine without CUDA raises
:class:`RuntimeError`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from data_plane.transfer.base import (
    D2H,
    H2D,
    BlockCopy,
    TransferEngine,
    TransferHandle,
    TransferStats,
)
from data_plane.transfer.segments import (  # re-exported: tests and benches import them here
    build_segments,
    check_copies,
    copy_ids,
    merge_runs_array,
)

# cudaError_t names that mean "the batched API is not there": fall back to per-segment copies.
_UNSUPPORTED = ("cudaErrorNotSupported", "cudaErrorCallRequiresNewerDriver")
_BATCH_MIN_DRIVER = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8


@dataclass(slots=True)
class CudaTransferStats(TransferStats):
    batched: bool = True  # False once the engine fell back to one cudaMemcpyAsync per segment
    enqueue_s: float = 0.0  # host seconds spent issuing copies, all submits together
    last_enqueue_s: float = 0.0  # host seconds of the latest submit


def _load_runtime() -> Any:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "CudaTransferEngine needs a CUDA device (torch.cuda.is_available() "
            "is False); use the 'cpu' transfer backend"
        )
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise RuntimeError(
            "CudaTransferEngine needs cuda-python (pip install "
            "'superinfer[cuda]'): cuda.bindings.runtime is missing"
        ) from exc
    return runtime


def _check_pools(hbm: torch.Tensor, dram: torch.Tensor) -> None:
    if not hbm.is_cuda:
        raise RuntimeError(f"the HBM pool must be a CUDA tensor, got device {hbm.device}")
    if dram.device.type != "cpu" or not dram.is_pinned():
        raise RuntimeError("the DRAM pool must be a pinned host tensor (pin_memory=True)")
    if not (hbm.is_contiguous() and dram.is_contiguous()):
        raise ValueError("both pools must be contiguous (block-first layout)")


class _Cuda:
    """Thin checked wrapper over ``cuda.bindings.runtime`` (or a test double of it)."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.success = rt.cudaError_t.cudaSuccess
        self.not_ready = rt.cudaError_t.cudaErrorNotReady
        self.unsupported = {getattr(rt.cudaError_t, n) for n in _UNSUPPORTED}

    def fail(self, err: Any, what: str) -> RuntimeError:
        _, msg = self.rt.cudaGetErrorString(err)
        text = msg.decode() if isinstance(msg, bytes) else str(msg)
        return RuntimeError(f"{what} failed: {err!r} ({text})")

    def check(self, ret: Any, what: str) -> Any:
        """Raise on a failed call; return the call's value (None, one value or a tuple)."""
        err = ret[0] if isinstance(ret, tuple) else ret
        if err != self.success:
            raise self.fail(err, what)
        if not isinstance(ret, tuple) or len(ret) == 1:
            return None
        return ret[1] if len(ret) == 2 else ret[1:]

    def new_event(self, timing: bool = False) -> Any:
        flags = self.rt.cudaEventDefault if timing else self.rt.cudaEventDisableTiming
        return self.check(self.rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags")

    def elapsed_s(self, start: Any, end: Any) -> float | None:
        """Seconds between two completed timing events; None when CUDA cannot tell."""
        ret = self.rt.cudaEventElapsedTime(start, end)
        if not isinstance(ret, tuple) or len(ret) < 2 or ret[0] != self.success:
            return None
        return float(ret[1]) / 1e3

    def record(self, event: Any, stream: Any) -> None:
        self.check(self.rt.cudaEventRecord(event, stream), "cudaEventRecord")

    def stream_wait(self, stream: Any, event: Any) -> None:
        self.check(self.rt.cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent")


class CudaTransferHandle(TransferHandle):
    """A CUDA event recorded after one direction's batch; owns (and destroys) the event.

    With ``start`` (a timing event recorded before the batch) and ``on_timed``, the batch's
    device time in seconds is passed to ``on_timed`` once, when the batch is first seen done.
    """

    __slots__ = ("_cuda", "_done", "_event", "_on_timed", "_start")

    def __init__(
        self,
        cuda: _Cuda,
        event: Any,
        start: Any | None = None,
        on_timed: Callable[[float], None] | None = None,
    ) -> None:
        self._cuda = cuda
        self._event = event
        self._start = start
        self._on_timed = on_timed
        self._done = False

    def done(self) -> bool:
        if self._done:
            return True
        ret = self._cuda.rt.cudaEventQuery(self._event)
        err = ret[0] if isinstance(ret, tuple) else ret
        if err == self._cuda.not_ready:
            return False
        self._cuda.check(ret, "cudaEventQuery")
        self._finish()
        return True

    def wait(self) -> None:
        if not self._done:
            self._cuda.check(
                self._cuda.rt.cudaEventSynchronize(self._event), "cudaEventSynchronize"
            )
            self._finish()

    def _finish(self) -> None:
        self._done = True
        on_timed, self._on_timed = self._on_timed, None
        if on_timed is not None and self._start is not None:
            seconds = self._cuda.elapsed_s(self._start, self._event)
            if seconds is not None:
                on_timed(seconds)

    def wait_on_stream(self, stream: int | Any) -> None:
        """Make ``stream`` (e.g. ``torch.cuda.current_stream().cuda_stream``) wait for this
        batch on the device, without blocking the host."""
        self._cuda.stream_wait(stream, self._event)

    def __del__(self) -> None:
        # Destroying a pending event is legal (CUDA frees it once it completes); at interpreter
        # shutdown the runtime may already be gone.
        for event in (self._event, self._start):
            if event is not None:
                with contextlib.suppress(Exception):
                    self._cuda.rt.cudaEventDestroy(event)


class CudaTransferEngine(TransferEngine):
    """Full-duplex block copies between a CUDA ``hbm`` pool and a pinned ``dram`` pool.

    ``order_after_current_stream``: each submit's copies start only after the work already
    queued on torch's current stream (KV writes to be saved, reads of blocks to be overwritten).
    ``check_hazards``: reject submits whose two directions touch the same block.
    ``measure_link``: time each batch with CUDA events for :attr:`meter` (two timing events per
    direction per submit instead of one event without timing).
    ``runtime``: a stand-in for ``cuda.bindings.runtime`` (tests); skips the device checks.
    """

    stats: CudaTransferStats

    def __init__(
        self,
        hbm: torch.Tensor,
        dram: torch.Tensor,
        *,
        order_after_current_stream: bool = True,
        prefer_overlap_with_compute: bool = False,
        check_hazards: bool = True,
        measure_link: bool = True,
        runtime: Any | None = None,
    ) -> None:
        super().__init__(hbm, dram)
        if runtime is None:
            runtime = _load_runtime()
            _check_pools(hbm, dram)
        self.stats = CudaTransferStats()
        self._cuda = _Cuda(runtime)
        self._device = hbm.device.index if hbm.device.type == "cuda" else 0
        self._threads: set[int] = set()
        self._set_device()
        self._order = order_after_current_stream
        self._check_hazards = check_hazards
        self._measure = measure_link
        self._hbm_base, self._dram_base = hbm.data_ptr(), dram.data_ptr()
        self._attrs = [self._batch_attrs(prefer_overlap_with_compute)]
        self.stats.batched = self._batch_available()
        rt, flags = runtime, runtime.cudaStreamNonBlocking
        self.h2d_stream = self._cuda.check(rt.cudaStreamCreateWithFlags(flags), "stream create")
        self.d2h_stream = self._cuda.check(rt.cudaStreamCreateWithFlags(flags), "stream create")
        self._order_event = self._cuda.new_event()
        self._closed = False

    @property
    def batched(self) -> bool:
        return self.stats.batched

    def _set_device(self) -> None:
        tid = threading.get_ident()
        if tid not in self._threads:
            self._cuda.check(self._cuda.rt.cudaSetDevice(self._device), "cudaSetDevice")
            self._threads.add(tid)

    def _batch_attrs(self, prefer_overlap: bool) -> Any:
        rt = self._cuda.rt
        attrs = rt.cudaMemcpyAttributes()
        attrs.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        if prefer_overlap:
            attrs.flags = int(rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute)
        return attrs

    def _batch_available(self) -> bool:
        if not hasattr(self._cuda.rt, "cudaMemcpyBatchAsync"):
            return False
        version = self._cuda.check(self._cuda.rt.cudaDriverGetVersion(), "cudaDriverGetVersion")
        return int(version) >= _BATCH_MIN_DRIVER

    def submit(
        self, h2d: list[BlockCopy], d2h: list[BlockCopy]
    ) -> tuple[CudaTransferHandle | None, CudaTransferHandle | None]:
        if self._closed:
            raise RuntimeError("submit on a closed CudaTransferEngine")
        t0 = time.perf_counter()
        h2d_ids, d2h_ids = copy_ids(h2d), copy_ids(d2h)
        check_copies(
            h2d_ids, d2h_ids, self.hbm.shape[0], self.dram.shape[0], hazards=self._check_hazards
        )
        self._count(h2d, d2h)
        self._set_device()
        if self._order and (h2d or d2h):
            self._after_current_stream(bool(h2d), bool(d2h))
        h = self._issue(H2D, h2d_ids, self._dram_base, self._hbm_base, self.h2d_stream)
        d = self._issue(D2H, d2h_ids, self._hbm_base, self._dram_base, self.d2h_stream)
        self.stats.last_enqueue_s = time.perf_counter() - t0
        self.stats.enqueue_s += self.stats.last_enqueue_s
        return h, d

    def _after_current_stream(self, h2d: bool, d2h: bool) -> None:
        current = torch.cuda.current_stream(self.hbm.device).cuda_stream
        self._cuda.record(self._order_event, current)
        for used, stream in ((h2d, self.h2d_stream), (d2h, self.d2h_stream)):
            if used:
                self._cuda.stream_wait(stream, self._order_event)

    def _issue(
        self,
        direction: str,
        ids: tuple[np.ndarray, np.ndarray],
        src_base: int,
        dst_base: int,
        stream: Any,
    ) -> CudaTransferHandle | None:
        if len(ids[0]) == 0:
            return None
        runs = merge_runs_array(*ids)
        self._count_segments(runs[:, 2].tolist())
        srcs, dsts, sizes = build_segments(runs, src_base, dst_base, self.block_bytes)
        start = self._cuda.new_event(timing=True) if self._measure else None
        try:
            if start is not None:
                self._cuda.record(start, stream)  # completes when the stream reaches the batch
            if self.stats.batched:
                self._copy_batched(srcs, dsts, sizes, stream)
            else:
                self._copy_each(srcs, dsts, sizes, stream)
        except BaseException:
            if start is not None:
                self._cuda.rt.cudaEventDestroy(start)
            raise
        event = self._cuda.new_event(timing=self._measure)
        self._cuda.record(event, stream)
        if start is None:
            return CudaTransferHandle(self._cuda, event)
        on_timed = partial(self.meter.record, direction, len(ids[0]) * self.block_bytes)
        return CudaTransferHandle(self._cuda, event, start, on_timed)

    def _copy_batched(
        self, srcs: np.ndarray, dsts: np.ndarray, sizes: np.ndarray, stream: Any
    ) -> None:
        count = len(srcs)
        ret = self._cuda.rt.cudaMemcpyBatchAsync(
            dsts.tolist(), srcs.tolist(), sizes.tolist(), count, self._attrs, [0], 1, stream
        )
        # CUDA 13 returns (err,); CUDA 12.8/12.9 bindings return (err, failIdx).
        err = ret[0] if isinstance(ret, tuple) else ret
        if err in self._cuda.unsupported:
            self.stats.batched = False
            self._copy_each(srcs, dsts, sizes, stream)
            return
        if err != self._cuda.success:
            fail = f", failIdx={ret[1]}" if isinstance(ret, tuple) and len(ret) > 1 else ""
            raise self._cuda.fail(err, f"cudaMemcpyBatchAsync of {count} segments{fail}")
        self.stats.num_copy_calls += 1

    def _copy_each(
        self, srcs: np.ndarray, dsts: np.ndarray, sizes: np.ndarray, stream: Any
    ) -> None:
        rt = self._cuda.rt
        kind = rt.cudaMemcpyKind.cudaMemcpyDefault
        for src, dst, size in zip(srcs.tolist(), dsts.tolist(), sizes.tolist(), strict=True):
            self._cuda.check(rt.cudaMemcpyAsync(dst, src, size, kind, stream), "cudaMemcpyAsync")
        self.stats.num_copy_calls += len(srcs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        rt = self._cuda.rt
        for stream in (self.h2d_stream, self.d2h_stream):
            rt.cudaStreamDestroy(stream)  # pending work still completes; resources freed after
        rt.cudaEventDestroy(self._order_event)
