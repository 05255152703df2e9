"""The transfer-engine interface shared by every backend.

Both pools are block-first tensors ``(num_blocks, num_layers, 2, block_size, kv_heads,
head_dim)``: one block is one contiguous segment, so a copy of ``n`` adjacent blocks is one
segment of ``n * block_bytes``. A backend gets at most one :meth:`TransferEngine.submit` per
iteration carrying every H2D and D2H block copy of that iteration, issues them (both
directions concurrently where the backend can) and returns one handle per direction. The
caller never blocks on a copy it does not need yet: it polls :meth:`TransferHandle.done`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class BlockCopy:
    src: int  # block id in the source pool
    dst: int  # block id in the destination pool


class TransferHandle(abc.ABC):
    """Completion of one direction's batch of copies."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once every copy of the batch has completed (never blocks)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the batch has completed."""


@dataclass(slots=True)
class TransferStats:
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    blocks_h2d: int = 0
    blocks_d2h: int = 0
    num_submits: int = 0
    num_copy_calls: int = 0  # API calls issued (1 per direction per submit when batched)
    num_segments: int = 0  # merged segments issued (bounded counters, not a growing list)
    max_segment_blocks: int = 0
    last_segments: list[int] = field(default_factory=list)  # lengths in the latest submit


def merge_runs(copies: list[BlockCopy]) -> list[tuple[int, int, int]]:
    """Merge copies into ``(src_start, dst_start, num_blocks)`` runs where both the source and
    destination ids are consecutive, after sorting by source id."""
    runs: list[tuple[int, int, int]] = []
    for copy in sorted(copies, key=lambda c: c.src):
        if runs:
            src, dst, count = runs[-1]
            if copy.src == src + count and copy.dst == dst + count:
                runs[-1] = (src, dst, count + 1)
                continue
        runs.append((copy.src, copy.dst, 1))
    return runs


class TransferEngine(abc.ABC):
    """Moves blocks between ``hbm`` and ``dram`` (same geometry, block-first layout)."""

    def __init__(self, hbm: torch.Tensor, dram: torch.Tensor) -> None:
        if hbm.shape[1:] != dram.shape[1:] or hbm.dtype != dram.dtype:
            raise ValueError(
                f"HBM and DRAM pools differ: {tuple(hbm.shape)} {hbm.dtype} vs "
                f"{tuple(dram.shape)} {dram.dtype}"
            )
        self.hbm = hbm
        self.dram = dram
        self.block_bytes = hbm[0].numel() * hbm.element_size()
        self.stats = TransferStats()

    @abc.abstractmethod
    def submit(
        self, h2d: list[BlockCopy], d2h: list[BlockCopy]
    ) -> tuple[TransferHandle | None, TransferHandle | None]:
        """Issue this iteration's copies; returns (h2d handle, d2h handle), None when empty."""

    def _count(self, h2d: list[BlockCopy], d2h: list[BlockCopy]) -> None:
        self.stats.last_segments = []
        self.stats.num_submits += 1
        self.stats.blocks_h2d += len(h2d)
        self.stats.blocks_d2h += len(d2h)
        self.stats.bytes_h2d += len(h2d) * self.block_bytes
        self.stats.bytes_d2h += len(d2h) * self.block_bytes

    def _count_segments(self, lengths: list[int]) -> None:
        self.stats.num_segments += len(lengths)
        self.stats.max_segment_blocks = max(self.stats.max_segment_blocks, *lengths, 0)
        self.stats.last_segments.extend(lengths)

    def close(self) -> None:  # noqa: B027 - a no-op unless the backend holds resources
        """Release streams/threads. Waits for nothing: callers drain handles first."""
