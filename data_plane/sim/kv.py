"""The real KV managers with one speed-up for long simulations: block tables that count their
blocks with ``list.count`` (C) instead of a Python generator.

``BlockTable.num_hbm`` / ``num_dram`` scan the table in Python; the engine reads both for every
request it snapshots, every iteration, which made them the simulator's top hot spot (a
ShareGPT request holds ~170 blocks). :class:`CountedBlockTable` is a ``BlockTable`` with the
same fields and results; the managers below only make sure every table they create is one.
Everything else is the unmodified manager code.
"""

from __future__ import annotations

from data_plane.kv.manager import SYNCED, BlockTable, KVCacheManager
from data_plane.kv.tiered import TieredKVCacheManager


class CountedBlockTable(BlockTable):
    __slots__ = ()

    @property
    def num_hbm(self) -> int:
        return len(self.hbm_ids) - self.hbm_ids.count(None)

    @property
    def num_synced(self) -> int:
        return self.sync.count(SYNCED)

    @property
    def num_dram(self) -> int:
        return len(self.dram_ids) - self.dram_ids.count(None)


class SimKVCacheManager(KVCacheManager):
    def ensure_hbm(self, request_id: str, num_computed: int, num_tokens: int) -> list[int] | None:
        if request_id not in self.tables:
            self.tables[request_id] = CountedBlockTable()
        return super().ensure_hbm(request_id, num_computed, num_tokens)


class SimTieredKVCacheManager(TieredKVCacheManager):
    def ensure_hbm(self, request_id: str, num_computed: int, num_tokens: int) -> list[int] | None:
        if request_id not in self.tables:
            self.tables[request_id] = CountedBlockTable()
        return super().ensure_hbm(request_id, num_computed, num_tokens)

    def rotate_out(self, request_id: str) -> bool:
        if request_id not in self.tables:
            self.tables[request_id] = CountedBlockTable()
        return super().rotate_out(request_id)
