"""The ``cpu`` backend: DuplexKV semantics with both pools in host memory.

Each direction has its own worker thread (the stand-in for a CUDA stream), so H2D and D2H run
concurrently with each other and with the model (torch releases the GIL while copying).
Adjacent blocks are merged into one slice copy per run, as the ``cuda`` backend merges segments.
Each batch's copy time, taken by its worker thread around the copies (not the time it waited in
the thread's queue), goes to the engine's :class:`~data_plane.transfer.base.LinkMeter`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from data_plane.transfer.base import (
    D2H,
    H2D,
    BlockCopy,
    LinkMeter,
    TransferEngine,
    TransferHandle,
    merge_runs,
)


class FutureHandle(TransferHandle):
    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def done(self) -> bool:
        if not self._future.done():
            return False
        self._future.result()  # re-raise a failed copy here, not silently
        return True

    def wait(self) -> None:
        self._future.result()


def copy_runs(
    src_pool: torch.Tensor, dst_pool: torch.Tensor, runs: list[tuple[int, int, int]]
) -> None:
    for src, dst, count in runs:
        dst_pool[dst : dst + count].copy_(src_pool[src : src + count])


def timed_copy_runs(
    src_pool: torch.Tensor,
    dst_pool: torch.Tensor,
    runs: list[tuple[int, int, int]],
    meter: LinkMeter,
    direction: str,
    num_bytes: int,
) -> None:
    """:func:`copy_runs`, then record its bytes and duration (a failed copy records nothing)."""
    t0 = time.perf_counter()
    copy_runs(src_pool, dst_pool, runs)
    meter.record(direction, num_bytes, time.perf_counter() - t0)


class CpuTransferEngine(TransferEngine):
    def __init__(self, hbm: torch.Tensor, dram: torch.Tensor) -> None:
        super().__init__(hbm, dram)
        self._h2d = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duplexkv-h2d")
        self._d2h = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duplexkv-d2h")

    def submit(
        self, h2d: list[BlockCopy], d2h: list[BlockCopy]
    ) -> tuple[TransferHandle | None, TransferHandle | None]:
        self._count(h2d, d2h)
        handles: list[TransferHandle | None] = []
        meter = self.meter
        for direction, copies, worker, src, dst in (
            (H2D, h2d, self._h2d, self.dram, self.hbm),
            (D2H, d2h, self._d2h, self.hbm, self.dram),
        ):
            if not copies:
                handles.append(None)
                continue
            runs = merge_runs(copies)
            self.stats.num_copy_calls += 1
            self._count_segments([count for _, _, count in runs])
            num_bytes = len(copies) * self.block_bytes
            future = worker.submit(timed_copy_runs, src, dst, runs, meter, direction, num_bytes)
            handles.append(FutureHandle(future))
        return handles[0], handles[1]

    def close(self) -> None:
        self._h2d.shutdown(wait=True)
        self._d2h.shutdown(wait=True)
