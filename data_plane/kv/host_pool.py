"""The host (DRAM) KV pool, pinned in chunks in the background.

Pinning is slow (1.7 GB/s measured on the H200 host, ANCHORS.md): a 400 GB pool would stall
start-up for minutes. The pool tensor is allocated pageable, the first chunk is pinned before
serving starts, and a background thread pins the rest chunk by chunk (``cudaHostRegister``).
The engine thread picks up progress in :meth:`TieredKVCacheManager.poll`, so only pinned
blocks are ever handed to the DMA engines.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

Register = Callable[[int, int], None]  # (pointer, nbytes) -> None; raises on failure


def cuda_host_register(pointer: int, nbytes: int) -> None:
    result = torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 0)
    if int(result) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with error {int(result)}")


class ChunkedPinner:
    """Pins ``tensor`` (blocks along dim 0) in chunks of ``chunk_blocks``; ``num_ready_blocks``
    counts the leading blocks that are pinned (read from any thread)."""

    def __init__(self, tensor: torch.Tensor, chunk_blocks: int, register: Register) -> None:
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
        self.tensor = tensor
        self.chunk_blocks = chunk_blocks
        self.register = register
        self.num_ready_blocks = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pin_first_chunk(self) -> int:
        self._pin_next()
        return self.num_ready_blocks

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dram-pinner", daemon=True)
        self._thread.start()

    def _pin_next(self) -> None:
        start = self.num_ready_blocks
        end = min(start + self.chunk_blocks, self.tensor.shape[0])
        block_bytes = self.tensor[0].numel() * self.tensor.element_size()
        self.register(self.tensor[start].data_ptr(), (end - start) * block_bytes)
        self.num_ready_blocks = end

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.num_ready_blocks < self.tensor.shape[0]:
                self._pin_next()
        except BaseException as exc:  # serve with what is pinned; report the failure
            self.error = exc

    def join(self) -> None:
        """Wait until every chunk is pinned (or pinning failed)."""
        if self._thread is not None:
            self._thread.join()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def done(self) -> bool:
        return self.num_ready_blocks >= self.tensor.shape[0]
