"""The transfer-engine interface shared by every backend.

Both pools are block-first tensors ``(num_blocks, num_layers, 2, block_size, kv_heads,
head_dim)``: one block is one contiguous segment, so a copy of ``n`` adjacent blocks is one
segment of ``n * block_bytes``. A backend gets at most one :meth:`TransferEngine.submit` per
iteration carrying every H2D and D2H block copy of that iteration, issues them (both
directions concurrently where the backend can) and returns one handle per direction. The
caller never blocks on a copy it does not need yet: it polls :meth:`TransferHandle.done`.

Every real backend measures its link: for each direction of each submit it records the bytes and
the seconds the copies took on the link (``cuda``: CUDA events around the batch on its copy
stream; ``cpu`` and ``naive``: the copy thread's clock around the copies) in a
:class:`LinkMeter`, which ``B_xfer=auto`` turns into a per-iteration budget.
"""

from __future__ import annotations

import abc
import math
import threading
from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class BlockCopy:
    src: int  # block id in the source pool
    dst: int  # block id in the destination pool


H2D, D2H = "h2d", "d2h"
LINK_WINDOW_BATCHES = 64
MIN_MEDIAN_BATCHES = 8  # batches in a direction's window before its median rate is used


class LinkMeter:
    """Measured copy bandwidth per direction over the last ``window`` batches of each.

    A batch is one direction of one submit: its bytes and the seconds its copies kept the link
    busy (from the first copy starting to the last one ending, not counting time queued behind
    earlier work). The rate of a direction is the median of its batches' rates over the
    window, once it holds ``MIN_MEDIAN_BATCHES`` (before: ``sum(bytes) / sum(seconds)``), and
    never below that ratio. A batch that stalled is an outlier the median ignores: the CPU
    backend's copy thread waits for the GIL while the serving loop runs Python, so one batch in
    twenty took 3-4 ms instead of 0.05 ms; summed, those stalls made the CPU worker's link
    0.08-0.18 GB/s where its batches ran at 1-3 GB/s, and B_xfer 15-59 blocks where the
    simulator planned with the whole link.

    Thread-safe: copy threads record, the serving loop reads.
    """

    def __init__(self, window: int = LINK_WINDOW_BATCHES) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 batch, got {window}")
        self.window = window
        self._lock = threading.Lock()
        self._batches: dict[str, deque[tuple[int, float]]] = {
            H2D: deque(maxlen=window),
            D2H: deque(maxlen=window),
        }
        self.num_batches = 0  # batches measured, all directions, since the start

    def _window(self, direction: str) -> deque[tuple[int, float]]:
        window = self._batches.get(direction)
        if window is None:
            raise ValueError(f"direction must be {H2D!r} or {D2H!r}, got {direction!r}")
        return window

    def record(self, direction: str, num_bytes: int, seconds: float) -> None:
        """One finished batch; ignored when it moved nothing or has no usable duration."""
        window = self._window(direction)
        if num_bytes <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        with self._lock:
            window.append((num_bytes, seconds))
            self.num_batches += 1

    def bytes_per_s(self, direction: str) -> float:
        """Bandwidth of ``direction`` over its window (see the class); 0.0 before any batch."""
        window = self._window(direction)
        with self._lock:
            batches = list(window)
        total_s = sum(s for _, s in batches)
        if total_s <= 0:
            return 0.0
        ratio = sum(b for b, _ in batches) / total_s  # stalls included: a lower bound
        if len(batches) < MIN_MEDIAN_BATCHES:
            return ratio
        rates = sorted(b / s for b, s in batches)
        return max(ratio, rates[len(rates) // 2])

    @property
    def link_bytes_per_s(self) -> float:
        """The slower of the measured directions (one direction's rate limits a budget that
        counts blocks per direction); 0.0 while nothing was measured."""
        rates = [r for r in (self.bytes_per_s(H2D), self.bytes_per_s(D2H)) if r > 0]
        return min(rates) if rates else 0.0


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
        self.meter = LinkMeter()

    @property
    def link_bytes_per_s(self) -> float:
        """Measured link bandwidth (:attr:`LinkMeter.link_bytes_per_s`); 0.0 if unmeasured
        (an engine that measures none overrides this)."""
        return self.meter.link_bytes_per_s

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
