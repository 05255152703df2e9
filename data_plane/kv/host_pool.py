"""The host (DRAM) KV pool, pinned in chunks in the background.

Pinning is slow (1.7 GB/s measured on the H200 host, ANCHORS.md): a 400 GB pool would stall
start-up for minutes. The pool tensor is allocated pageable, the first chunk is pinned before
serving starts, and a background thread pins the rest chunk by chunk (``cudaHostRegister``).
The engine thread picks up progress in :meth:`KVCacheManager.poll`, so only pinned
blocks are ever handed to the DMA engines.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

Register = Callable[[int, int], None]  # (pointer, nbytes) -> None; raises on failure
Unregister = Callable[[int], None]


def _set_device(runtime: Any, device: int | None) -> None:
    """Make ``device`` current on the calling thread (a new thread starts on device 0, and a
    CUDA call there would create a context on the wrong GPU)."""
    if device is not None:
        (err,) = runtime.cudaSetDevice(device)
        if err != runtime.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaSetDevice({device}) failed: {err.name}")


def cuda_host_register(pointer: int, nbytes: int, device: int | None = None) -> None:
    from cuda.bindings import runtime

    _set_device(runtime, device)
    (err,) = runtime.cudaHostRegister(pointer, nbytes, runtime.cudaHostRegisterDefault)
    if err != runtime.cudaError_t.cudaSuccess:
        runtime.cudaGetLastError()  # do not leave the error for the next torch call
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err.name}")


def cuda_host_unregister(pointer: int, device: int | None = None) -> None:
    from cuda.bindings import runtime

    _set_device(runtime, device)
    (err,) = runtime.cudaHostUnregister(pointer)
    if err != runtime.cudaError_t.cudaSuccess:
        runtime.cudaGetLastError()


def allocate_host_pool(
    num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """A zeroed, page-aligned host pool in its own anonymous mapping: its pages are shared
    with no other allocation, so registering (pinning) them never overlaps another range."""
    element = torch.tensor([], dtype=dtype).element_size()
    nbytes = num_blocks * element * int(torch.Size(block_shape).numel())
    buffer = mmap.mmap(-1, max(nbytes, 1))
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
    return flat.view(dtype).view(num_blocks, *block_shape)


def _unregister_all(pointers: list[int], unregister: Unregister) -> None:
    while pointers:
        unregister(pointers.pop())


class ChunkedPinner:
    """Pins ``tensor`` (blocks along dim 0) in chunks of ``chunk_blocks``; ``num_ready_blocks``
    counts the leading blocks that are pinned (read from any thread)."""

    def __init__(
        self,
        tensor: torch.Tensor,
        chunk_blocks: int,
        register: Register,
        unregister: Unregister | None = None,
    ) -> None:
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
        self.tensor = tensor
        self.chunk_blocks = chunk_blocks
        self.register = register
        self.num_ready_blocks = 0
        # Registered ranges are unregistered before the memory can be freed and reused (a
        # later pool at the same address would otherwise fail: "already registered").
        self._registered: list[int] = []
        self._finalizer = weakref.finalize(
            self, _unregister_all, self._registered, unregister or (lambda _pointer: None)
        )
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
        pointer = self.tensor[start].data_ptr()
        self.register(pointer, (end - start) * block_bytes)
        self._registered.append(pointer)
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

    def close(self) -> None:
        """Stop pinning and unregister every pinned chunk (the pool must be idle)."""
        self.stop()
        self._finalizer()

    @property
    def done(self) -> bool:
        return self.num_ready_blocks >= self.tensor.shape[0]
