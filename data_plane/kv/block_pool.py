"""A pool of fixed-size KV blocks in one memory tier (HBM or host DRAM)."""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """A tier has fewer free blocks than asked for."""


class BlockPool:
    """Free-list allocator over block ids ``0 .. num_blocks-1``. Double frees raise."""

    def __init__(self, num_blocks: int, name: str) -> None:
        if num_blocks < 0:
            raise ValueError(f"{name}: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocksError(f"{self.name}: asked for {count} blocks, {self.num_free} free")
        ids = [self._free.popleft() for _ in range(count)]
        for block_id in ids:
            self._is_free[block_id] = False
        return ids

    def free(self, ids: list[int]) -> None:
        for block_id in ids:
            if self._is_free[block_id]:
                raise RuntimeError(f"{self.name}: block {block_id} freed twice")
            self._is_free[block_id] = True
            self._free.append(block_id)

    def grow(self, num_blocks: int) -> None:
        """Add blocks ``self.num_blocks .. num_blocks-1`` (a pool pinned in chunks grows)."""
        for block_id in range(self.num_blocks, num_blocks):
            self._free.append(block_id)
            self._is_free.append(True)
        self.num_blocks = max(self.num_blocks, num_blocks)
