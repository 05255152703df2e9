"""A transfer engine with no tensors: copies complete at a virtual time given by a link model.

Link models (seconds from the start of a submit until each direction's copies are done):

- :class:`DuplexLink` (DuplexKV): one batched call per direction, both directions at once; the
  whole submit takes ``costmodel.transfer_time_s(profile, bytes_h2d, bytes_d2h)`` (each
  direction at its own rate, together no faster than the profile's duplex aggregate) and both
  directions complete together at its end.
- :class:`NaiveLink` (vLLM's layer-first per-segment copies, ``data_plane/transfer/naive.py``):
  one copy call per layer per K/V per block, one direction at a time (H2D, then D2H). Each call
  costs a fixed launch/latency overhead plus its bytes at the link rate. The overhead is derived
  from one measured anchor, ``anchor_rate`` for ``anchor_segment_bytes`` segments:
  ``overhead = S / anchor_rate - S / link_rate``. Llama-3-8B's segment is a block's K or V of
  one layer: 2 MiB / (32 layers x 2) = 32 KiB, so the effective rate is lower than the
  anchor's (which used 64 KiB segments). See :func:`naive_link` for the anchors.

A submit starts when the previous one on the link has finished (batches queue on the link).
:meth:`SimulatedHandle.wait` is called only when the engine has nothing to compute; it moves the
virtual clock to the completion time, and that time is counted as exposed transfer time.
Copies running under an iteration's compute slow the compute down (the simulated executor asks
:meth:`SimulatedTransferEngine.busy_s_between` and charges ``costmodel.copy_interference_s``);
the copies themselves keep the link model's timing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from data_plane.transfer.base import BlockCopy, TransferEngine, TransferHandle, TransferStats
from lab.costmodel import CostProfile, transfer_time_s
from lab.sim.clock import VirtualClock

KIB = 1024
NAIVE_SEGMENT_ANCHOR_BYTES = 64 * KIB
# Measured per-segment copy rates with 64 KiB segments, (H2D, D2H) bytes/s, and where from.
NAIVE_ANCHORS: dict[str, tuple[float, float, str]] = {
    "h200": (
        7.29e9,
        7.29e9,
        "ANCHORS.md: 1 GiB of 64 KiB segments, one copy call each, "
        "7.29 GB/s on the lent H200 (PCIe Gen5)",
    ),
    "gh200": (
        9.86e9,
        10.75e9,
        "SUPERINFER.md Table 1, 'Naive per-segment copies' row, GH200 "
        "(64 KiB segments of Qwen2.5-32B): H2D 9.86, D2H 10.75 GB/s, one direction "
        "at a time",
    ),
}
LLAMA3_8B_NUM_LAYERS = 32


class LinkModel(Protocol):
    @property
    def name(self) -> str: ...

    def completion_s(self, bytes_h2d: int, bytes_d2h: int) -> tuple[float, float]:
        """Seconds from the submit's start until its (H2D, D2H) copies are done."""
        ...

    def calls(self, blocks_h2d: int, blocks_d2h: int) -> int:
        """Copy API calls one submit makes."""
        ...


@dataclass(frozen=True, slots=True)
class DuplexLink:
    profile: CostProfile
    name: str = "duplex"

    def completion_s(self, bytes_h2d: int, bytes_d2h: int) -> tuple[float, float]:
        seconds = transfer_time_s(self.profile, bytes_h2d, bytes_d2h)
        return seconds, seconds

    def calls(self, blocks_h2d: int, blocks_d2h: int) -> int:
        return (blocks_h2d > 0) + (blocks_d2h > 0)


@dataclass(frozen=True, slots=True)
class NaiveLink:
    h2d_bytes_s: float  # effective rates with this model's segment size
    d2h_bytes_s: float
    segments_per_block: int
    name: str = "naive"

    def completion_s(self, bytes_h2d: int, bytes_d2h: int) -> tuple[float, float]:
        h2d_s = bytes_h2d / self.h2d_bytes_s
        return h2d_s, h2d_s + bytes_d2h / self.d2h_bytes_s

    def calls(self, blocks_h2d: int, blocks_d2h: int) -> int:
        return (blocks_h2d + blocks_d2h) * self.segments_per_block


def naive_link(profile: CostProfile, num_layers: int = LLAMA3_8B_NUM_LAYERS) -> NaiveLink:
    """The naive backend on ``profile``'s link: the anchor of the profile's GPU (by name prefix,
    "gh200" or else "h200"), rescaled to this model's per-layer segment size."""
    anchor = NAIVE_ANCHORS["gh200" if profile.name.startswith("gh200") else "h200"]
    block_bytes = profile.kv_bytes_per_token * profile.block_size_tokens
    segment = block_bytes / (2 * num_layers)
    rates = []
    for anchor_rate, link_rate in (
        (anchor[0], profile.link_h2d_bytes_s),
        (anchor[1], profile.link_d2h_bytes_s),
    ):
        overhead_s = max(
            0.0, NAIVE_SEGMENT_ANCHOR_BYTES / anchor_rate - NAIVE_SEGMENT_ANCHOR_BYTES / link_rate
        )
        rates.append(segment / (overhead_s + segment / link_rate))
    return NaiveLink(rates[0], rates[1], 2 * num_layers)


class SimulatedHandle(TransferHandle):
    __slots__ = ("_engine", "t_done_s")

    def __init__(self, engine: SimulatedTransferEngine, t_done_s: float) -> None:
        self._engine = engine
        self.t_done_s = t_done_s

    def done(self) -> bool:
        return self._engine.clock.now >= self.t_done_s

    def wait(self) -> None:
        clock = self._engine.clock
        if clock.now < self.t_done_s:
            self._engine.exposed_transfer_s += self.t_done_s - clock.now
            clock.now = self.t_done_s


class SimulatedTransferEngine(TransferEngine):
    """The TransferEngine interface over a :class:`LinkModel` and a virtual clock."""

    def __init__(self, clock: VirtualClock, link: LinkModel, block_bytes: int) -> None:
        # TransferEngine.__init__ checks two pool tensors; there are none here.
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        self.clock = clock
        self.link = link
        self.block_bytes = block_bytes
        self.stats = TransferStats()
        self.link_free_s = 0.0  # when the last submitted batch completes
        self.link_busy_s = 0.0
        self.exposed_transfer_s = 0.0

    @property
    def link_bytes_per_s(self) -> float:
        """Nothing is measured in virtual time (the link model is known): 0.0."""
        return 0.0

    def submit(
        self, h2d: list[BlockCopy], d2h: list[BlockCopy]
    ) -> tuple[TransferHandle | None, TransferHandle | None]:
        self._count(h2d, d2h)
        if not h2d and not d2h:
            return None, None
        self.stats.num_copy_calls += self.link.calls(len(h2d), len(d2h))
        h2d_s, d2h_s = self.link.completion_s(
            len(h2d) * self.block_bytes, len(d2h) * self.block_bytes
        )
        start = max(self.clock.now, self.link_free_s)
        self.link_free_s = start + max(h2d_s, d2h_s)
        self.link_busy_s += max(h2d_s, d2h_s)
        return (
            SimulatedHandle(self, start + h2d_s) if h2d else None,
            SimulatedHandle(self, start + d2h_s) if d2h else None,
        )

    def busy_s_between(self, t0_s: float, t1_s: float) -> float:
        """Seconds within [``t0_s``, ``t1_s``] the link is copying, for ``t0_s`` not before
        the last submit: batches queue back to back from their submits, so from then on the
        link is busy without a gap until ``link_free_s``."""
        return max(0.0, min(self.link_free_s, t1_s) - t0_s)
