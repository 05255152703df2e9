"""The ``naive`` backend: vLLM's layer-first way of moving KV, as a baseline for ablations.

One copy call per layer per K/V per block, one stream (here one worker thread), one direction
at a time: H2D copies of a submit run first, then its D2H copies, never concurrently. Each
direction's copy time (the worker thread's clock around its copies and the stream sync after
them) goes to the engine's :class:`~data_plane.transfer.base.LinkMeter`.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from data_plane.transfer.base import D2H, H2D, BlockCopy, TransferEngine, TransferHandle
from data_plane.transfer.cpu import FutureHandle


def copy_per_layer(src_pool: torch.Tensor, dst_pool: torch.Tensor, copies: list[BlockCopy]) -> None:
    non_blocking = src_pool.is_cuda != dst_pool.is_cuda
    num_layers = src_pool.shape[1]
    for copy in copies:
        for layer in range(num_layers):
            for kv in (0, 1):
                dst_pool[copy.dst, layer, kv].copy_(
                    src_pool[copy.src, layer, kv], non_blocking=non_blocking
                )
    if src_pool.is_cuda or dst_pool.is_cuda:
        torch.cuda.current_stream().synchronize()


class NaiveTransferEngine(TransferEngine):
    def __init__(self, hbm: torch.Tensor, dram: torch.Tensor) -> None:
        super().__init__(hbm, dram)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="naive-kv")
        self._stream = torch.cuda.Stream() if hbm.is_cuda else None

    def _run(
        self, direction: str, src: torch.Tensor, dst: torch.Tensor, copies: list[BlockCopy]
    ) -> None:
        t0 = time.perf_counter()
        if self._stream is None:
            copy_per_layer(src, dst, copies)
        else:
            with torch.cuda.stream(self._stream):
                copy_per_layer(src, dst, copies)
        self.meter.record(direction, len(copies) * self.block_bytes, time.perf_counter() - t0)

    def submit(
        self, h2d: list[BlockCopy], d2h: list[BlockCopy]
    ) -> tuple[TransferHandle | None, TransferHandle | None]:
        self._count(h2d, d2h)
        calls = 2 * self.hbm.shape[1]
        self.stats.num_copy_calls += calls * (len(h2d) + len(d2h))
        h2d_handle = d2h_handle = None
        if h2d:
            h2d_handle = FutureHandle(self._worker.submit(self._run, H2D, self.dram, self.hbm, h2d))
        if d2h:  # queued behind the H2D batch on the same worker: one direction at a time
            d2h_handle = FutureHandle(self._worker.submit(self._run, D2H, self.hbm, self.dram, d2h))
        return h2d_handle, d2h_handle

    def close(self) -> None:
        self._worker.shutdown(wait=True)
