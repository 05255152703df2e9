"""Prefix caching: full KV blocks indexed by their content, shared by reference count.

As vLLM V1 does it: a full block's key is a hash chained over the keys of the blocks before
it and its own token ids, so equal keys mean equal prefixes (the cache also keeps each block's
parent key and tokens and compares them on a hit, so a hash collision is a miss, never a
wrong block). Only full blocks are cached; they are immutable, so any number of requests may
read one. A block's reference count is the number of block tables holding it; when it drops
to 0 a cached block is not freed but parked in an LRU of evictable blocks, still indexed, and
taken back (evicted, its index entry dropped) only when the pool's free list is empty. A block
in use is never evicted.

The same pool serves both tiers: in HBM it is vLLM's prefix cache; in host DRAM it indexes
the copies DuplexKV's eager sync already made (``data_plane/kv/tiered.py``), so a prefix
evicted from HBM can come back with one H2D copy instead of a prefill.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from data_plane.kv.block_pool import BlockPool, OutOfBlocksError

ROOT_KEY = 0  # the parent key of a request's first block


def block_keys(
    token_ids: Sequence[int], block_size: int, start: int = 0, parent: int = 0
) -> list[int]:
    """The keys of the full blocks of ``token_ids`` from block ``start`` on (``parent``: the
    key of block ``start - 1``, ``ROOT_KEY`` for the first)."""
    keys: list[int] = []
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[begin : begin + block_size])))
        keys.append(parent)
    return keys


@dataclass(frozen=True, slots=True)
class _Content:
    key: int
    parent: int
    tokens: tuple[int, ...]


@dataclass(slots=True)
class CacheCounters:
    """Lookups in blocks, as vLLM counts its prefix cache (queries and hits, per token there;
    here per block, the unit that is shared)."""

    num_queried_blocks: int = 0
    num_hit_blocks: int = 0
    num_evicted_blocks: int = 0


class CachingBlockPool:
    """A :class:`BlockPool` whose full blocks can be indexed by content and shared.

    ``allocate`` returns blocks with one reference each, taking free blocks first and then the
    least recently released cached ones; ``free`` drops one reference per id; ``num_free``
    counts both the free list and the evictable cached blocks (what an allocation can get)."""

    def __init__(self, num_blocks: int, name: str, enabled: bool = True) -> None:
        self._pool = BlockPool(num_blocks, name)
        self.name = name
        self.enabled = enabled
        self._refs = [0] * num_blocks
        self._content: dict[int, _Content] = {}  # block id -> what it holds (cached blocks)
        self._block_of: dict[int, int] = {}  # key -> block id
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, no references
        self._changed_keys: set[int] = set()  # what a lookup may now answer differently
        self.counters = CacheCounters()

    # ---- BlockPool's interface -----------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free(self) -> int:
        return self._pool.num_free + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks indexed by content (in use or evictable)."""
        return len(self._content)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfBlocksError(f"{self.name}: asked for {count} blocks, {self.num_free} free")
        from_free = min(count, self._pool.num_free)
        ids = self._pool.allocate(from_free)
        for _ in range(count - from_free):
            block_id, _ = self._evictable.popitem(last=False)  # least recently released
            self._forget(block_id)
            self.counters.num_evicted_blocks += 1
            ids.append(block_id)
        for block_id in ids:
            self._refs[block_id] = 1
        return ids

    def free(self, ids: Sequence[int]) -> None:
        """Drop one reference to each block; an unreferenced cached block becomes evictable,
        an uncached one free."""
        for block_id in ids:
            refs = self._refs[block_id]
            if refs <= 0:
                raise RuntimeError(f"{self.name}: block {block_id} freed twice")
            self._refs[block_id] = refs - 1
            if refs == 1:
                content = self._content.get(block_id)
                if content is not None:
                    self._evictable[block_id] = None
                    self._changed_keys.add(content.key)  # in use -> evictable
                else:
                    self._pool.free([block_id])

    def grow(self, num_blocks: int) -> None:
        """More blocks are usable (a pool pinned in chunks grows)."""
        self._pool.grow(num_blocks)
        self._refs.extend([0] * (self._pool.num_blocks - len(self._refs)))

    def refs(self, block_id: int) -> int:
        return self._refs[block_id]

    # ---- the index -----------------------------------------------------------------------
    def register(self, block_id: int, key: int, parent: int, tokens: Sequence[int]) -> int:
        """Index ``block_id`` (full, in use) as holding ``tokens`` after ``parent``; returns the
        block now indexed under ``key`` (an earlier block with the same content wins)."""
        if not self.enabled:
            return block_id
        known = self._block_of.get(key)
        if known is not None:
            return known
        if block_id in self._content:  # already indexed (e.g. under a colliding key)
            return block_id
        self._block_of[key] = block_id
        self._content[block_id] = _Content(key, parent, tuple(tokens))
        self._changed_keys.add(key)
        return block_id

    def cached_block(self, key: int, parent: int, tokens: Sequence[int]) -> int | None:
        """The block holding exactly ``tokens`` after ``parent``, or None (no reference taken)."""
        block_id = self._block_of.get(key)
        if block_id is None:
            return None
        content = self._content[block_id]
        if content.parent != parent or content.tokens != tuple(tokens):
            return None  # a hash collision: a miss, never a wrong block
        return block_id

    def take(self, block_id: int) -> None:
        """One more reference to a cached block (a hit), out of the evictable LRU if there."""
        if self._refs[block_id] == 0:
            del self._evictable[block_id]
            self._changed_keys.add(self._content[block_id].key)  # evictable -> in use
        self._refs[block_id] += 1

    def drain_changed_keys(self) -> set[int]:
        """The keys whose lookup (:meth:`cached_block`) or use (:meth:`refs` > 0) changed
        since the last drain: indexed, evicted, taken from or released to the LRU."""
        changed, self._changed_keys = self._changed_keys, set()
        return changed

    def clear(self) -> int:
        """Drop the index of every evictable block (they become free); returns how many."""
        num = len(self._evictable)
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget(block_id)
            self._pool.free([block_id])
        return num

    def _forget(self, block_id: int) -> None:
        content = self._content.pop(block_id)
        self._changed_keys.add(content.key)
        if self._block_of.get(content.key) == block_id:
            del self._block_of[content.key]
