"""The KV cache manager: HBM + host DRAM with DuplexKV rotation (SUPERINFER.md §2, §5).

Without a DRAM tier (:meth:`KVCacheManager.hbm_only`) it is the same manager with an empty DRAM
pool and no transfer engine: nothing rotates (``rotate_out`` is refused, the policy's budget
is 0) and every request is resident.

- Eager sync: a block that becomes full is queued for a D2H copy to its DRAM twin and marked
  synced when that copy completes. Only full (immutable) blocks travel D2H in the background.
- Rotate out: synced HBM blocks are dropped without copying; only unsynced ones (at most the
  partly filled tail, plus full blocks whose sync has not run yet) are copied D2H, and their HBM
  blocks are freed when the copy completes.
- Rotate in: allocate HBM, copy H2D; the request is not resident (attention never reads the
  blocks) until every copy completed. A request rotates in only after its rotate-out finished.
- At most ``b_xfer_blocks`` blocks are issued per iteration, in one submit (one batched call per
  direction), before the iteration's compute starts, so copies overlap compute; the queues,
  batches in flight and busy blocks are :class:`~data_plane.kv.copies.CopyPipeline`'s.
- A block is never freed or reused while a copy from or to it is in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from data_plane.kv.copies import EVICT, LOAD, SYNC, Content, CopyPipeline, Move, TieredStats
from data_plane.kv.host_pool import ChunkedPinner
from data_plane.kv.manager import (
    PENDING,
    SYNCED,
    UNSYNCED,
    BlockTable,
    BlockTables,
    KVEvent,
    KVEventKind,
    KVStats,
    PrefixHits,
    PrefixTaken,
)
from data_plane.kv.prefix_cache import ROOT_KEY, CachingBlockPool
from data_plane.transfer.base import TransferEngine


class KVCacheManager(BlockTables):
    """What the engine asks of the KV layer: admit (:meth:`take_prefix`), grow
    (:meth:`ensure_hbm`), park/unpark (:meth:`rotate_out`/:meth:`rotate_in`), free,
    :meth:`poll` the copies, per-request counts (:meth:`block_counts`,
    :meth:`rotary_columns`) and :meth:`stats`."""

    def __init__(
        self,
        num_hbm_blocks: int,
        num_dram_blocks: int,
        block_size: int,
        transfer: TransferEngine | None,
        b_xfer_blocks: int,
        eager_sync: bool = True,
        num_dram_blocks_ready: int | None = None,
        pinner: ChunkedPinner | None = None,
        prefix_caching: bool = False,
        dram_prefix_caching: bool = True,
    ) -> None:
        """``prefix_caching``: HBM's prefix cache; with ``dram_prefix_caching`` too, the eager
        syncs' DRAM copies are indexed as a second level (a prefix evicted from HBM comes back
        by one H2D copy, and a block already in DRAM is not copied again)."""
        super().__init__(num_hbm_blocks, block_size, prefix_caching)
        has_dram = num_dram_blocks > 0
        if has_dram and (transfer is None or b_xfer_blocks < 1):
            raise ValueError(
                f"a DRAM tier needs a transfer engine and b_xfer_blocks >= 1, got {b_xfer_blocks}"
            )
        ready = num_dram_blocks if num_dram_blocks_ready is None else num_dram_blocks_ready
        self.dram = CachingBlockPool(ready, "dram", enabled=prefix_caching and dram_prefix_caching)
        self.num_dram_blocks_total = num_dram_blocks
        self.b_xfer_blocks = b_xfer_blocks if has_dram else 0
        self.eager_sync = eager_sync and has_dram
        self.pinner = pinner
        self.tiered_stats = TieredStats()
        self._copies = CopyPipeline(self.hbm, self.dram, transfer, self.tiered_stats)
        self._events: list[KVEvent] = []  # completions since the last poll

    @classmethod
    def hbm_only(
        cls, num_hbm_blocks: int, block_size: int, prefix_caching: bool = False
    ) -> KVCacheManager:
        """One tier: an empty DRAM pool, no transfer engine."""
        return cls(num_hbm_blocks, 0, block_size, None, 0, prefix_caching=prefix_caching)

    @property
    def has_dram(self) -> bool:
        return self.num_dram_blocks_total > 0

    @property
    def num_free_dram_blocks(self) -> int:
        return self.dram.num_free

    def table(self, request_id: str) -> BlockTable | None:
        return self.tables.get(request_id)

    def rotary_columns(self, request_ids: Sequence[str]) -> dict[str, Any]:
        """What changes while requests are rotary, as columns: their blocks per tier as
        their copies complete."""
        num = len(request_ids)
        rows = [self.tables.get(rid) for rid in request_ids]
        return {
            "num_blocks_hbm": np.fromiter((t.num_hbm if t else 0 for t in rows), np.int64, num),
            "num_blocks_dram": np.fromiter((t.num_dram if t else 0 for t in rows), np.int64, num),
        }

    def stats(self) -> KVStats:
        stats, dram = self.tiered_stats, self.dram
        return KVStats(
            num_hbm_blocks=self.hbm.num_blocks,
            num_free_hbm_blocks=self.hbm.num_free,
            num_cached_hbm_blocks=self.hbm.num_cached,
            num_dram_blocks=dram.num_blocks,
            num_free_dram_blocks=dram.num_free,
            num_cached_dram_blocks=dram.num_cached,
            num_blocks_loaded=stats.blocks_loaded,
            num_blocks_stored=stats.blocks_synced + stats.blocks_evicted,
            link_bytes_per_s=self.link_bytes_per_s,
            prefix=self.prefix_counters,
        )

    @property
    def transfer(self) -> TransferEngine | None:
        return self._copies.transfer

    @property
    def num_queued_blocks(self) -> int:
        """Copies waiting to be issued (they use up future iterations' budgets)."""
        return self._copies.num_queued

    @property
    def link_bytes_per_s(self) -> float:
        """The transfer engine's measured copy bandwidth (bytes/s, the slower direction over
        its recent batches); 0.0 until a batch completed, or when the engine measures none."""
        return self.transfer.link_bytes_per_s if self.transfer is not None else 0.0

    def set_b_xfer_blocks(self, num_blocks: int) -> None:
        """The per-iteration transfer budget (at least one block: rotation never stalls;
        0 without a DRAM tier: nothing moves)."""
        self.b_xfer_blocks = max(1, num_blocks) if self.has_dram else 0

    @property
    def num_queued_rotation_blocks(self) -> int:
        """Rotation copies queued, not yet issued (they use up the next budgets)."""
        return self._copies.num_queued_urgent

    @property
    def b_xfer_available(self) -> int:
        """The budget a policy may plan with: B_xfer minus rotation copies still queued."""
        return max(0, self.b_xfer_blocks - self._copies.num_queued_urgent)

    def grow_dram(self, num_ready_blocks: int) -> None:
        """More of the DRAM pool is usable (pinned) now."""
        self.dram.grow(min(num_ready_blocks, self.num_dram_blocks_total))

    def is_resident(self, request_id: str) -> bool:
        """No copy into HBM pending and not rotated out (for tests and tools: the engine
        follows :meth:`poll`'s events)."""
        table = self.tables.get(request_id)
        return table is None or (table.num_pending_h2d == 0 and not table.rotated_out)

    def on_computed(
        self,
        request_id: str,
        num_computed_tokens: int,
        token_ids: Sequence[int] = (),
        keys: Sequence[int] = (),
    ) -> None:
        super().on_computed(request_id, num_computed_tokens, token_ids, keys)
        table = self.tables.get(request_id)
        if table is None or not self.eager_sync:
            return
        num_full = num_computed_tokens // self.block_size
        for index in range(table.num_sync_checked, num_full):
            if table.sync[index] != UNSYNCED:
                continue
            content = self._content(index, token_ids, keys)
            if content is not None and self._share_dram_copy(table, index, content):
                continue
            if not self._queue_d2h(SYNC, request_id, table, index, content):
                num_full = index  # DRAM is full: this block is tried again at the next step
                break
        table.num_sync_checked = max(table.num_sync_checked, num_full)

    def _content(self, index: int, token_ids: Sequence[int], keys: Sequence[int]) -> Content | None:
        if not self.dram.enabled or index >= len(keys) or not token_ids:
            return None
        bs = self.block_size
        parent = keys[index - 1] if index else ROOT_KEY
        return keys[index], parent, token_ids[index * bs : (index + 1) * bs]

    def _share_dram_copy(self, table: BlockTable, index: int, content: Content) -> bool:
        """Eager sync of a block DRAM already holds: take that copy, copy nothing."""
        if table.dram_ids[index] is not None:
            return False
        dram_id = self.dram.cached_block(*content)
        if dram_id is None:
            return False
        self.dram.take(dram_id)
        table.dram_ids[index] = dram_id
        table.num_dram += 1
        table.sync[index] = SYNCED
        return True

    # ---- prefix caching: DRAM, the second level ----------------------------------------------
    def prefix_hits(self, token_ids: Sequence[int], keys: Sequence[int]) -> PrefixHits:
        hits = super().prefix_hits(token_ids, keys)
        if not self.dram.enabled or not keys:
            return hits
        limit = min(len(keys), (len(token_ids) - 1) // self.block_size)
        dram = self._walk(self.dram, token_ids, keys, hits.num_hbm, limit)
        return hits._replace(num_dram=len(dram))

    def drain_prefix_changes(self) -> set[int]:
        return super().drain_prefix_changes() | self.dram.drain_changed_keys()

    def take_prefix(
        self, request_id: str, token_ids: Sequence[int], keys: Sequence[int]
    ) -> PrefixTaken:
        """An admitted request shares HBM's cached prefix; the blocks that follow it in
        DRAM's index are loaded into new HBM blocks (H2D, within B_xfer: the request is not
        resident until they are in, :meth:`poll` reports it ``LOADED``)."""
        num_hbm = self._take_hbm_prefix(request_id, token_ids, keys)
        table = self.tables.get(request_id)
        if table is None or not self.dram.enabled or not keys or table.rotated_out:
            return PrefixTaken(num_hbm)
        limit = min(len(keys), (len(token_ids) - 1) // self.block_size)
        hits = self._walk(self.dram, token_ids, keys, num_hbm, limit)[: self.hbm.num_free]
        if len(table.hbm_ids) != num_hbm or not hits:
            return PrefixTaken(num_hbm)
        for dram_id in hits:
            self.dram.take(dram_id)
        for index, (dram_id, hbm_id) in enumerate(
            zip(hits, self.hbm.allocate(len(hits)), strict=True), start=num_hbm
        ):
            table.hbm_ids.append(hbm_id)
            table.dram_ids.append(dram_id)
            table.sync.append(SYNCED)
            self._copies.queue(Move(LOAD, request_id, index, hbm_id, dram_id, table))
        table.num_hbm += len(hits)
        table.num_dram += len(hits)
        table.num_pending_h2d += len(hits)
        self.prefix_counters.num_dram_hit_tokens += len(hits) * self.block_size
        return PrefixTaken(num_hbm + len(hits), len(hits))

    def _queue_d2h(
        self,
        kind: str,
        request_id: str,
        table: BlockTable,
        index: int,
        content: Content | None = None,
    ) -> bool:
        dram_id = table.dram_ids[index]
        if dram_id is None:
            if self.dram.num_free == 0:
                return False
            dram_id = self.dram.allocate(1)[0]
            table.dram_ids[index] = dram_id
            table.num_dram += 1
        hbm_id = table.hbm_ids[index]
        assert hbm_id is not None
        table.sync[index] = PENDING
        self._copies.queue(Move(kind, request_id, index, hbm_id, dram_id, table, content))
        return True

    # ---- rotation ------------------------------------------------------------------------
    def rotate_out(self, request_id: str) -> int | None:
        """Park the request's KV in DRAM: returns how many blocks are still being copied out
        (0: parked now; else :meth:`poll` reports it ``PARKED``), None when it cannot (no
        DRAM tier, no room, or its KV is still being copied in: those loads target HBM blocks
        that parking would free for another request)."""
        if not self.has_dram:
            return None
        table = self.tables.get(request_id)
        if table is None:
            table = self.tables[request_id] = BlockTable()
        if table.num_pending_h2d:
            return None
        needed = sum(
            1 for i, d in enumerate(table.dram_ids) if d is None and table.sync[i] != SYNCED
        )
        if needed > self.dram.num_free:
            return None
        table.rotated_out = True
        # Queued eager syncs become evictions; syncs in flight count as evictions and free
        # their HBM block on completion.
        self._copies.syncs_to_evictions(request_id)
        table.num_pending_evict += sum(1 for s in table.sync if s == PENDING)
        for index, state in enumerate(table.sync):
            if state == SYNCED:
                self._drop_hbm(table, index)
                self.tiered_stats.blocks_dropped += 1
            elif state == UNSYNCED:
                self._queue_d2h(EVICT, request_id, table, index)
                table.num_pending_evict += 1
        return table.num_pending_evict

    def rotate_in(self, request_id: str) -> int | None:
        """Start copying a parked request back: returns how many blocks are being copied in
        (0: resident now; else :meth:`poll` reports it ``LOADED``), None while HBM is short
        or its rotate-out is in flight."""
        table = self.tables.get(request_id)
        if table is None:
            return 0  # rotated out before it computed anything
        if table.num_pending_evict:
            return None  # its rotate-out is still in flight
        missing = [i for i, h in enumerate(table.hbm_ids) if h is None]
        if len(missing) > self.hbm.num_free:
            return None
        table.rotated_out = False
        for index, hbm_id in zip(missing, self.hbm.allocate(len(missing)), strict=True):
            dram_id = table.dram_ids[index]
            assert dram_id is not None and table.sync[index] == SYNCED
            table.hbm_ids[index] = hbm_id
            table.num_hbm += 1
            self._copies.queue(Move(LOAD, request_id, index, hbm_id, dram_id, table))
        table.num_pending_h2d += len(missing)
        return len(missing)

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is None:
            return
        self._copies.forget(request_id)
        for hbm_id in reversed(table.hbm_ids):  # tail first: evicted before the prefix's root
            if hbm_id is not None:
                self._copies.release_hbm(hbm_id)
        for dram_id in reversed(table.dram_ids):
            if dram_id is not None:
                self._copies.release_dram(dram_id)

    def _drop_hbm(self, table: BlockTable, index: int) -> None:
        hbm_id = table.hbm_ids[index]
        if hbm_id is not None:
            table.hbm_ids[index] = None
            table.num_hbm -= 1
            self._copies.release_hbm(hbm_id)

    # ---- the pipeline --------------------------------------------------------------------
    def issue_transfers(self) -> None:
        """Issue up to ``b_xfer_blocks`` queued copies (rotation first, then eager syncs) as one
        submit; they run while this iteration computes."""
        self._copies.issue(self.b_xfer_blocks)

    def after_compute(self) -> None:
        self._copies.after_compute()

    def poll(self) -> list[KVEvent]:
        """Retire completed copies and pick up newly pinned DRAM (never blocks); returns
        what completed since the last poll: requests now resident (``LOADED``) or parked
        (``PARKED``)."""
        self._retire()
        events, self._events = self._events, []
        return events

    def _retire(self) -> None:
        if self.pinner is not None and self.pinner.num_ready_blocks > self.dram.num_blocks:
            self.grow_dram(self.pinner.num_ready_blocks)
        for move in self._copies.retire():
            if self.tables.get(move.request_id) is move.table:  # not freed (and not re-created)
                self._apply_completion(move, move.table)

    def wait_for_progress(self) -> None:
        self._copies.wait_for_progress()

    def drain(self) -> None:
        """Wait for every queued and in-flight copy (shutdown, tests)."""
        while self._copies.busy:
            self._copies.wait_all()
            self._retire()
            self.issue_transfers()

    def close(self) -> None:
        """Finish every copy, stop the transfer engine and release pinned host memory."""
        self.drain()
        self._copies.close()
        if self.pinner is not None:
            self.pinner.close()

    def _apply_completion(self, move: Move, table: BlockTable) -> None:
        stats = self.tiered_stats
        if move.kind == LOAD:
            table.num_pending_h2d -= 1
            stats.blocks_loaded += 1
            if table.num_pending_h2d == 0 and not table.rotated_out:
                self._events.append(KVEvent(move.request_id, KVEventKind.LOADED))
            return
        table.sync[move.index] = SYNCED
        if move.content is not None:
            self.dram.register(move.dram_id, *move.content)
        if move.kind == SYNC and not table.rotated_out:
            stats.blocks_synced += 1
            return
        stats.blocks_evicted += 1
        table.num_pending_evict -= 1
        if table.rotated_out:
            self._drop_hbm(table, move.index)
            if table.num_pending_evict == 0:
                self._events.append(KVEvent(move.request_id, KVEventKind.PARKED))
