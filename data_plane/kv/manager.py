"""Per-request block tables over the HBM pool (and, with DuplexKV, the DRAM pool)."""

from __future__ import annotations

from dataclasses import dataclass, field

from data_plane.kv.block_pool import BlockPool


@dataclass(slots=True)
class BlockTable:
    """Where each of a request's blocks lives. ``hbm_ids[i]`` and ``dram_ids[i]`` are the
    i-th logical block in each tier (``None`` where it has no copy there)."""

    hbm_ids: list[int] = field(default_factory=list)
    dram_ids: list[int | None] = field(default_factory=list)
    synced: list[bool] = field(default_factory=list)

    @property
    def num_hbm(self) -> int:
        return len(self.hbm_ids)

    @property
    def num_dram(self) -> int:
        return sum(1 for d in self.dram_ids if d is not None)


class KVCacheManager:
    """Single-tier block accounting (HBM only); :class:`TieredKVCacheManager` adds DRAM."""

    def __init__(self, num_hbm_blocks: int, block_size: int) -> None:
        self.hbm = BlockPool(num_hbm_blocks, "hbm")
        self.block_size = block_size
        self.tables: dict[str, BlockTable] = {}
        self.b_xfer_blocks = 0

    @property
    def num_free_dram_blocks(self) -> int:
        return 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> BlockTable | None:
        return self.tables.get(request_id)

    def is_resident(self, request_id: str) -> bool:
        return True

    def ensure_hbm(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's HBM blocks to hold ``num_tokens``; None if HBM is short."""
        table = self.tables.setdefault(request_id, BlockTable())
        missing = self.blocks_for(num_tokens) - table.num_hbm
        if missing > self.hbm.num_free:
            return None
        if missing > 0:
            table.hbm_ids.extend(self.hbm.allocate(missing))
            table.dram_ids.extend([None] * missing)
            table.synced.extend([False] * missing)
        return table.hbm_ids

    def on_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """KV of ``num_computed_tokens`` tokens now exists (eager sync hooks in here)."""

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.hbm.free(table.hbm_ids)

    def rotate_out(self, request_id: str) -> None:
        raise RuntimeError("rotation needs a DRAM tier (set dram_kv_gib or num_dram_blocks)")

    def rotate_in(self, request_id: str) -> bool:
        raise RuntimeError("rotation needs a DRAM tier (set dram_kv_gib or num_dram_blocks)")

    def poll(self) -> None:
        """Retire completed transfers (none without a DRAM tier)."""

    def issue_transfers(self) -> None:
        """Start this iteration's queued transfers (none without a DRAM tier)."""
