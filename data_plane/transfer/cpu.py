"""The ``cpu`` backend: DuplexKV semantics with both pools in host memory.

Each direction has its own worker thread (the stand-in for a CUDA stream), so H2D and D2H run
concurrently with each other and with the model (torch releases the GIL while copying).
Adjacent blocks are merged into one slice copy per run, as the ``cuda`` backend merges segments.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from data_plane.transfer.base import BlockCopy, TransferEngine, TransferHandle, merge_runs


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
        for copies, worker, src, dst in (
            (h2d, self._h2d, self.dram, self.hbm),
            (d2h, self._d2h, self.hbm, self.dram),
        ):
            if not copies:
                handles.append(None)
                continue
            runs = merge_runs(copies)
            self.stats.num_copy_calls += 1
            self._count_segments([count for _, _, count in runs])
            handles.append(FutureHandle(worker.submit(copy_runs, src, dst, runs)))
        return handles[0], handles[1]

    def close(self) -> None:
        self._h2d.shutdown(wait=True)
        self._d2h.shutdown(wait=True)
