"""Pure numpy helpers of the ``cuda`` backend: block ids to merged segments and pointer arrays,
and the checks a submit must pass (ids in range, no race between its two directions)."""

from __future__ import annotations

import numpy as np

from data_plane.transfer.base import BlockCopy


def copy_ids(copies: list[BlockCopy]) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination block ids of ``copies`` as int64 arrays."""
    n = len(copies)
    src = np.fromiter((c.src for c in copies), dtype=np.int64, count=n)
    dst = np.fromiter((c.dst for c in copies), dtype=np.int64, count=n)
    return src, dst


def merge_runs_array(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Vectorised :func:`merge_runs`: ``(k, 3)`` int64 rows ``(src_start, dst_start, count)``
    after a stable sort by source id, merging where both ids advance by exactly one."""
    n = len(src)
    if n == 0:
        return np.zeros((0, 3), dtype=np.int64)
    order = np.argsort(src, kind="stable")
    s, d = src[order], dst[order]
    brk = np.ones(n, dtype=bool)
    brk[1:] = (np.diff(s) != 1) | (np.diff(d) != 1)
    starts = np.flatnonzero(brk)
    counts = np.diff(np.append(starts, n))
    return np.stack([s[starts], d[starts], counts], axis=1).astype(np.int64, copy=False)


def build_segments(
    runs: np.ndarray | list[tuple[int, int, int]], src_base: int, dst_base: int, block_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pointer/size arrays (uint64) for ``runs``: segment ``i`` copies ``count * block_bytes``
    bytes from ``src_base + src_start * block_bytes`` to ``dst_base + dst_start * block_bytes``."""
    arr = np.asarray(runs, dtype=np.uint64).reshape(-1, 3)
    bb = np.uint64(block_bytes)
    srcs = np.uint64(src_base) + arr[:, 0] * bb
    dsts = np.uint64(dst_base) + arr[:, 1] * bb
    sizes = arr[:, 2] * bb
    return srcs, dsts, sizes


def _check_ids(name: str, ids: np.ndarray, num_blocks: int) -> None:
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"{name} block id out of range [0, {num_blocks})")


def check_copies(
    h2d: tuple[np.ndarray, np.ndarray],
    d2h: tuple[np.ndarray, np.ndarray],
    num_hbm: int,
    num_dram: int,
    hazards: bool = True,
) -> None:
    """Raise ValueError for out-of-range ids and, with ``hazards``, for copies of one submit
    that race: a destination written twice, or a block that one direction writes while the
    other reads it (both directions run concurrently)."""
    (h_src, h_dst), (d_src, d_dst) = h2d, d2h
    _check_ids("h2d source (DRAM)", h_src, num_dram)
    _check_ids("h2d destination (HBM)", h_dst, num_hbm)
    _check_ids("d2h source (HBM)", d_src, num_hbm)
    _check_ids("d2h destination (DRAM)", d_dst, num_dram)
    if not hazards:
        return
    for name, dst, src, pool in (("h2d", h_dst, d_src, num_hbm), ("d2h", d_dst, h_src, num_dram)):
        written = np.zeros(pool, dtype=bool)
        written[dst] = True
        if int(np.count_nonzero(written)) != len(dst):
            raise ValueError(f"{name} writes one destination block twice in one submit")
        if written[src].any():
            where = "an HBM" if name == "h2d" else "a DRAM"
            raise ValueError(f"{where} block is written by {name} and read by the other direction")
