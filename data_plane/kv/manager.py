"""Per-request block tables over the HBM pool (and, with DuplexKV, the DRAM pool)."""

from __future__ import annotations

from dataclasses import dataclass, field

from data_plane.kv.block_pool import BlockPool

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


class KVCacheManager:
    """Single-tier block accounting (HBM only); :class:`TieredKVCacheManager` adds DRAM."""

    def __init__(self, num_hbm_blocks: int, block_size: int) -> None:
        self.hbm = BlockPool(num_hbm_blocks, "hbm")
        self.block_size = block_size
        self.tables: dict[str, BlockTable] = {}
        self.b_xfer_blocks = 0

    @property
    def b_xfer_available(self) -> int:
        return self.b_xfer_blocks

    @property
    def num_free_dram_blocks(self) -> int:
        return 0

    @property
    def link_bytes_per_s(self) -> float:
        """Measured host-link bandwidth; no link without a DRAM tier."""
        return 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> BlockTable | None:
        return self.tables.get(request_id)

    def is_resident(self, request_id: str) -> bool:
        return True

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

    def on_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """KV of ``num_computed_tokens`` tokens now exists (eager sync hooks in here)."""

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.hbm.free([h for h in table.hbm_ids if h is not None])

    def rotate_out(self, request_id: str) -> bool:
        """Park the request's KV in DRAM; False when it cannot (no DRAM tier / room)."""
        return False

    def rotate_in(self, request_id: str) -> bool:
        """Start copying a rotary request back; False while HBM is short."""
        return False

    def close(self) -> None:
        """Release transfer resources (none without a DRAM tier)."""

    def wait_for_progress(self) -> None:
        """Block until the oldest in-flight copy completes (nothing else to do)."""

    def after_compute(self) -> None:
        """Called when an iteration's compute ended (transfer overlap accounting)."""

    def poll(self) -> None:
        """Retire completed transfers (none without a DRAM tier)."""

    def issue_transfers(self) -> None:
        """Start this iteration's queued transfers (none without a DRAM tier)."""
