"""Host integer lists to device tensors without a blocking copy.

A step's metadata (token ids, positions, slot rows, context lengths, block tables, tiles) is
written into one pinned host buffer and moved by non-blocking copies on the current stream, so
the host goes on building the step while the copy runs. An event recorded after the copies
guards the pinned buffer: the next step waits for it (already complete in steady state, since
each step reads its sampled tokens back) before writing the buffer again. The device buffer is
reused the same way; stream order puts the next copy after every kernel of this step.

Off CUDA the same code runs with an ordinary host buffer (the copies are plain copies).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_DEFAULT_CAPACITY = 1 << 15  # int64 elements; grows on demand


def padded_table_array(tables: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """Every table padded with block 0 to ``width`` columns, as an int64 array (a padded
    column is never read: attention stops at the context length)."""
    out = np.zeros((len(tables), width), dtype=np.int64)
    for row, table in enumerate(tables):
        if len(table) > width:
            raise ValueError(f"a block table is wider than {width} columns")
        out[row, : len(table)] = table
    return out


class HostStaging:
    """One pinned host buffer and one device buffer of int64 for a step's small inputs."""

    def __init__(self, device: torch.device, capacity: int = _DEFAULT_CAPACITY) -> None:
        self.device = device
        self._on_cuda = device.type == "cuda"
        self._event = torch.cuda.Event() if self._on_cuda else None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self._host = torch.empty(capacity, dtype=torch.long, pin_memory=self._on_cuda)
        self._host_view = self._host.numpy()
        self._device_buffer = torch.empty(capacity, dtype=torch.long, device=self.device)

    def _fill(self, arrays: Sequence[np.ndarray]) -> list[tuple[int, int]]:
        """Write ``arrays`` back to back into the pinned buffer: (start, end) of each."""
        total = sum(int(a.size) for a in arrays)
        self._wait_for_previous_copy()
        if total > self._host.numel():
            self._allocate(max(total, 2 * self._host.numel()))
        spans, start = [], 0
        for array in arrays:
            end = start + int(array.size)
            self._host_view[start:end] = array.reshape(-1)
            spans.append((start, end))
            start = end
        return spans

    def stage(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device copies of ``arrays`` (each keeps its shape), views of one device buffer filled
        by one non-blocking copy; valid until the next call."""
        spans = self._fill(arrays)
        total = spans[-1][1] if spans else 0
        self._device_buffer[:total].copy_(self._host[:total], non_blocking=True)
        self._record()
        return [
            self._device_buffer[start:end].view(array.shape)
            for array, (start, end) in zip(arrays, spans, strict=True)
        ]

    def _record(self) -> None:
        if self._event is not None:  # on the stream of this device, whichever device is current
            self._event.record(torch.cuda.current_stream(self.device))

    def _wait_for_previous_copy(self) -> None:
        if self._event is not None:
            self._event.synchronize()
