"""Per-request block tables over the HBM pool, HBM's prefix cache and the KV layer's stats
(the DRAM tier and its copies: :mod:`data_plane.kv.tiered`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from data_plane.kv.prefix_cache import ROOT_KEY, CachingBlockPool, block_keys

UNSYNCED, PENDING, SYNCED = 0, 1, 2  # state of a block's DRAM twin


@dataclass(slots=True)
class BlockTable:
    """Where each of a request's blocks lives. ``hbm_ids[i]`` and ``dram_ids[i]`` are the
    i-th logical block in each tier (``None`` where it has no copy there)."""

    hbm_ids: list[int | None] = field(default_factory=list)
    dram_ids: list[int | None] = field(default_factory=list)
    sync: list[int] = field(default_factory=list)  # UNSYNCED / PENDING / SYNCED per block
    rotated_out: bool = False
    num_pending_h2d: int = 0  # blocks still being copied back; not resident until 0
    num_pending_evict: int = 0  # rotate-out copies still in flight
    num_sync_checked: int = 0  # leading full blocks already considered for eager sync
    num_indexed: int = 0  # leading full blocks offered to the prefix cache's index
    # Blocks present in each tier, kept by the managers as they fill or clear slots (the
    # snapshot reads them for every request every iteration).
    num_hbm: int = 0
    num_dram: int = 0

    @property
    def num_synced(self) -> int:
        return self.sync.count(SYNCED)

    def recount(self) -> tuple[int, int]:
        """(HBM, DRAM) blocks counted from the id lists (tests check the counters with it)."""
        return (
            len(self.hbm_ids) - self.hbm_ids.count(None),
            len(self.dram_ids) - self.dram_ids.count(None),
        )


class PrefixTaken(NamedTuple):
    """What an admitted request took of the caches: ``num_blocks`` leading blocks need no
    prefill, ``num_loading`` of them (the DRAM part) are still being copied in."""

    num_blocks: int = 0
    num_loading: int = 0


class KVEventKind(enum.Enum):
    LOADED = "loaded"  # the last copy into HBM completed: the request is resident
    PARKED = "parked"  # the last rotate-out copy completed: its KV lives in DRAM only


class KVEvent(NamedTuple):
    request_id: str
    kind: KVEventKind


class PrefixHits(NamedTuple):
    """What the prefix caches hold of a request's leading full blocks: ``num_hbm`` blocks in
    HBM (``num_hbm_in_use`` of them held by running requests, the rest evictable, so taking
    them uses up free blocks), then ``num_dram`` more in host DRAM (loaded H2D)."""

    num_hbm: int = 0
    num_hbm_in_use: int = 0
    num_dram: int = 0

    @property
    def num_blocks(self) -> int:
        return self.num_hbm + self.num_dram


@dataclass(slots=True)
class PrefixCounters:
    """Prefix-cache lookups at admission, in tokens (vLLM's ``prefix_cache_queries`` and
    ``prefix_cache_hits``), with the hits split per tier."""

    num_queried_tokens: int = 0
    num_hbm_hit_tokens: int = 0
    num_dram_hit_tokens: int = 0


@dataclass(frozen=True, slots=True)
class KVStats:
    """The tiers' sizes and use, the copies done and the prefix caches' counters, as one
    value (the DRAM fields are zero without a DRAM tier)."""

    num_hbm_blocks: int
    num_free_hbm_blocks: int
    num_cached_hbm_blocks: int
    num_dram_blocks: int
    num_free_dram_blocks: int
    num_cached_dram_blocks: int
    num_blocks_loaded: int  # H2D copies completed (rotate-in and DRAM prefix loads)
    num_blocks_stored: int  # D2H copies completed (eager syncs and rotate-out evictions)
    link_bytes_per_s: float  # measured copy bandwidth; 0.0 until measured or without a link
    prefix: PrefixCounters


class BlockTables:
    """Per-request block tables over the HBM pool, with HBM's prefix cache when
    ``prefix_caching`` (full blocks indexed by content and shared,
    :mod:`data_plane.kv.prefix_cache`). The base of :class:`~data_plane.kv.tiered.
    KVCacheManager`, which adds the DRAM tier and its copies; nothing here is a stand-in."""

    def __init__(self, num_hbm_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        self.hbm = CachingBlockPool(num_hbm_blocks, "hbm", enabled=prefix_caching)
        self.block_size = block_size
        self.tables: dict[str, BlockTable] = {}
        self.prefix_caching = prefix_caching
        self.prefix_counters = PrefixCounters()

    @property
    def num_hbm_blocks(self) -> int:
        return self.hbm.num_blocks

    @property
    def num_free_hbm_blocks(self) -> int:
        """What an allocation can get now (free and evictable cached blocks)."""
        return self.hbm.num_free

    def block_counts(self, request_id: str) -> tuple[int, int]:
        """(HBM, DRAM) blocks the request holds now."""
        table = self.tables.get(request_id)
        return (table.num_hbm, table.num_dram) if table is not None else (0, 0)

    def num_synced_blocks(self, request_ids: Sequence[str]) -> list[int]:
        """Per request, its blocks whose DRAM copy is current (a rotate-out drops them)."""
        tables = self.tables
        return [table.num_synced if (table := tables.get(rid)) else 0 for rid in request_ids]

    # ---- prefix keys ---------------------------------------------------------------------
    def prefix_keys(self, token_ids: Sequence[int]) -> list[int]:
        """The keys of the full blocks of a new request's prompt (none without caching)."""
        return block_keys(token_ids, self.block_size) if self.prefix_caching else []

    def extend_prefix_keys(
        self, keys: list[int], token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Append to ``keys`` those of the blocks that filled up to ``num_computed_tokens``."""
        if num_computed_tokens // self.block_size > len(keys):
            parent = keys[-1] if keys else ROOT_KEY
            keys.extend(
                block_keys(token_ids[:num_computed_tokens], self.block_size, len(keys), parent)
            )

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ensure_hbm(self, request_id: str, num_computed: int, num_tokens: int) -> list[int] | None:
        """Grow the request's HBM blocks to hold ``num_tokens`` (tokens from ``num_computed``
        on are about to be written); None if HBM is short."""
        table = self.tables.setdefault(request_id, BlockTable())
        missing = self.blocks_for(num_tokens) - len(table.hbm_ids)
        if missing > self.hbm.num_free:
            return None
        if missing > 0:
            table.hbm_ids.extend(self.hbm.allocate(missing))
            table.num_hbm += missing
            table.dram_ids.extend([None] * missing)
            table.sync.extend([UNSYNCED] * missing)
        for index in range(num_computed // self.block_size, len(table.hbm_ids)):
            if table.sync[index] == SYNCED:  # the partly filled tail: its DRAM twin goes stale
                table.sync[index] = UNSYNCED
        return table.hbm_ids  # type: ignore[return-value]

    def on_computed(
        self,
        request_id: str,
        num_computed_tokens: int,
        token_ids: Sequence[int] = (),
        keys: Sequence[int] = (),
    ) -> None:
        """KV of ``num_computed_tokens`` tokens now exists: its full blocks join the prefix
        index (``token_ids``/``keys``: the request's tokens and full blocks' keys, given
        whenever a block filled; eager sync hooks in here too)."""
        table = self.tables.get(request_id)
        if table is None or not keys or not self.hbm.enabled:
            return
        num_full = min(num_computed_tokens // self.block_size, len(keys), len(table.hbm_ids))
        bs = self.block_size
        for index in range(table.num_indexed, num_full):
            hbm_id = table.hbm_ids[index]
            if hbm_id is not None:
                parent = keys[index - 1] if index else ROOT_KEY
                tokens = token_ids[index * bs : (index + 1) * bs]
                self.hbm.register(hbm_id, keys[index], parent, tokens)
        table.num_indexed = max(table.num_indexed, num_full)

    # ---- prefix caching --------------------------------------------------------------------
    def prefix_hits(self, token_ids: Sequence[int], keys: Sequence[int]) -> PrefixHits:
        """What the caches hold of this prompt now (nothing is taken). At least the last
        token is always left to compute (its logits start the output)."""
        if not self.hbm.enabled or not keys:
            return PrefixHits()
        limit = min(len(keys), (len(token_ids) - 1) // self.block_size)
        hbm = self._walk(self.hbm, token_ids, keys, 0, limit)
        in_use = sum(1 for block_id in hbm if self.hbm.refs(block_id) > 0)
        return PrefixHits(len(hbm), in_use, 0)

    def drain_prefix_changes(self) -> set[int]:
        """Block keys whose :meth:`prefix_hits` answer may have changed since the last call
        (the engine refreshes the waiting requests whose prefix runs through them)."""
        return self.hbm.drain_changed_keys()

    def _take_hbm_prefix(
        self, request_id: str, token_ids: Sequence[int], keys: Sequence[int]
    ) -> int:
        """A request starts: share the cached HBM blocks of its prefix (a new block table
        holding them); returns how many leading blocks need no prefill."""
        self.prefix_counters.num_queried_tokens += len(token_ids)
        if not self.hbm.enabled or not keys or request_id in self.tables:
            return 0
        limit = min(len(keys), (len(token_ids) - 1) // self.block_size)
        hits = self._walk(self.hbm, token_ids, keys, 0, limit)
        table = self.tables[request_id] = BlockTable()
        for block_id in hits:
            self.hbm.take(block_id)
        table.hbm_ids.extend(hits)
        table.dram_ids.extend([None] * len(hits))
        table.sync.extend([UNSYNCED] * len(hits))
        table.num_hbm = table.num_indexed = len(hits)
        self.prefix_counters.num_hbm_hit_tokens += len(hits) * self.block_size
        return len(hits)

    def _walk(
        self,
        pool: CachingBlockPool,
        token_ids: Sequence[int],
        keys: Sequence[int],
        start: int,
        limit: int,
    ) -> list[int]:
        """The blocks of ``pool`` holding blocks ``start..`` of the prompt, up to the first
        miss or ``limit``."""
        bs, hits = self.block_size, []
        for index in range(start, limit):
            parent = keys[index - 1] if index else ROOT_KEY
            block_id = pool.cached_block(
                keys[index], parent, token_ids[index * bs : (index + 1) * bs]
            )
            if block_id is None:
                break
            hits.append(block_id)
        return hits
