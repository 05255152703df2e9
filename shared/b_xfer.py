"""B_xfer, the blocks DuplexKV may move per iteration (SUPERINFER.md §4), as the services
compute it: a fixed knob, or ``auto`` from the link bandwidth a worker measured and its
iteration time. The worker (planning locally) and the control plane (in its plans) use the same
functions, so they agree. The simulator's model of it is in ``lab/costmodel.py``."""

from __future__ import annotations

import math


def b_xfer_blocks_at_rate(link_bytes_s: float, iteration_s: float, block_bytes: int) -> int:
    """B_xfer: blocks a link direction at ``link_bytes_s`` moves in ``iteration_s`` seconds,
    ``floor(link_bytes_s * iteration_s / block_bytes)``, at least 1."""
    if not (math.isfinite(link_bytes_s) and link_bytes_s >= 0):
        raise ValueError(f"link_bytes_s must be finite and >= 0, got {link_bytes_s}")
    if not (math.isfinite(iteration_s) and iteration_s >= 0):
        raise ValueError(f"iteration_s must be finite and >= 0, got {iteration_s}")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
    return max(1, math.floor(link_bytes_s * iteration_s / block_bytes))


def measured_b_xfer_blocks(
    link_bytes_per_s: float, iteration_s: float, block_bytes: int, current_blocks: int
) -> int:
    """``B_xfer=auto`` on a running worker: :func:`b_xfer_blocks_at_rate` of the link bandwidth
    it measured and its last iteration time; ``current_blocks`` while nothing is measured
    (``link_bytes_per_s`` 0) or ``block_bytes`` is unknown. The control plane and a worker
    planning locally both use this, so they agree."""
    if link_bytes_per_s <= 0 or block_bytes <= 0:
        return current_blocks
    return b_xfer_blocks_at_rate(link_bytes_per_s, iteration_s, block_bytes)


def resolve_b_xfer_blocks(
    knob: int | None,
    link_bytes_per_s: float,
    iteration_s: float,
    block_bytes: int,
    current_blocks: int,
) -> int:
    """The budget a worker runs with: the ``b_xfer`` knob when fixed, else (``auto``)
    :func:`measured_b_xfer_blocks`. The control plane puts it in its plans and a worker
    planning locally sets it itself, with this one function."""
    if knob is not None:
        return knob
    return measured_b_xfer_blocks(link_bytes_per_s, iteration_s, block_bytes, current_blocks)
