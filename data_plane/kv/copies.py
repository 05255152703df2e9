"""DuplexKV's copy pipeline: queued block copies, the batches in flight, and the blocks they
touch (SUPERINFER.md §5).

Owned by :class:`~data_plane.kv.tiered.KVCacheManager`, which decides what to copy; the pipeline
decides when: rotation copies (evictions and loads) before eager syncs, at most a budget of
blocks per iteration, all of them in one submit (one batched call per direction) so that they
run under the iteration's compute. A block is never freed while a copy from or to it is in
flight: its free waits for the copy (:meth:`CopyPipeline.release_hbm`).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from data_plane.kv.manager import BlockTable
from data_plane.kv.prefix_cache import CachingBlockPool
from data_plane.transfer.base import BlockCopy, TransferEngine, TransferHandle

EVICT, SYNC, LOAD = "evict", "sync", "load"
Content = tuple[int, int, Sequence[int]]  # a full block's (key, parent key, tokens)
RECENT_ITERATIONS = 1024  # TieredStats.per_iteration_blocks keeps this many


@dataclass(frozen=True, slots=True, eq=False)
class Move:
    """One block copy: EVICT / SYNC (HBM to DRAM) or LOAD (DRAM to HBM)."""

    kind: str
    request_id: str
    index: int  # logical block index in the request's table
    hbm_id: int
    dram_id: int
    # The table the move belongs to: a request preempted by recompute and admitted again gets
    # a new table, and a copy still in flight for the old one must not touch it.
    table: BlockTable
    content: Content | None = None  # an eager sync's block, indexed in DRAM once copied


@dataclass(slots=True)
class _Batch:
    moves: list[Move]
    handles: list[TransferHandle]
    t_issue_s: float
    compute_ended: bool = False
    exposed_from_s: float | None = None  # compute ended before the copies did

    def done(self) -> bool:
        return all(h.done() for h in self.handles)


@dataclass(slots=True)
class TieredStats:
    blocks_synced: int = 0  # eager syncs completed
    blocks_evicted: int = 0  # rotate-out copies completed
    blocks_loaded: int = 0  # rotate-in copies completed
    blocks_dropped: int = 0  # synced HBM blocks dropped at rotate-out without a copy
    max_blocks_per_iteration: int = 0
    num_batches: int = 0
    num_batches_hidden: int = 0  # done by the end of the compute they overlapped
    exposed_transfer_s: float = 0.0
    # blocks issued in each of the last RECENT_ITERATIONS iterations (a ring: a worker runs
    # forever); the all-time peak is max_blocks_per_iteration
    per_iteration_blocks: deque[int] = field(
        default_factory=lambda: deque(maxlen=RECENT_ITERATIONS)
    )


class _BusyBlocks:
    """Copies in flight per block of one pool, and the frees waiting for them (a shared
    block can have several of each)."""

    def __init__(self, pool: CachingBlockPool) -> None:
        self.pool = pool
        self._num_copies: Counter[int] = Counter()
        self._num_deferred_frees: Counter[int] = Counter()

    def copy_started(self, block_id: int) -> None:
        self._num_copies[block_id] += 1

    def release(self, block_id: int) -> None:
        if block_id in self._num_copies:
            self._num_deferred_frees[block_id] += 1  # freed when its copies complete
        else:
            self.pool.free([block_id])

    def copy_done(self, block_id: int) -> None:
        self._num_copies[block_id] -= 1
        if self._num_copies[block_id] <= 0:
            del self._num_copies[block_id]
            num_frees = self._num_deferred_frees.pop(block_id, 0)
            if num_frees:
                self.pool.free([block_id] * num_frees)


class CopyPipeline:
    """Queues, issues and retires block copies; see the module docstring."""

    def __init__(
        self,
        hbm: CachingBlockPool,
        dram: CachingBlockPool,
        transfer: TransferEngine | None,
        stats: TieredStats,
    ) -> None:
        self.transfer = transfer
        self.stats = stats
        self._hbm = _BusyBlocks(hbm)
        self._dram = _BusyBlocks(dram)
        self._urgent: deque[Move] = deque()  # evictions and loads: rotation waits on these
        self._syncs: deque[Move] = deque()  # eager syncs: background
        self._in_flight: list[_Batch] = []

    @property
    def num_queued(self) -> int:
        """Copies waiting to be issued (they use up future iterations' budgets)."""
        return len(self._urgent) + len(self._syncs)

    @property
    def num_queued_urgent(self) -> int:
        return len(self._urgent)

    @property
    def busy(self) -> bool:
        """Copies queued or in flight."""
        return bool(self._in_flight or self._urgent or self._syncs)

    def queue(self, move: Move) -> None:
        (self._syncs if move.kind == SYNC else self._urgent).append(move)

    def syncs_to_evictions(self, request_id: str) -> None:
        """The request's queued (not yet issued) eager syncs become evictions (it is rotating
        out); those in flight complete as they are."""
        kept: deque[Move] = deque()
        for move in self._syncs:
            if move.request_id == request_id:
                self._urgent.append(
                    Move(
                        EVICT,
                        request_id,
                        move.index,
                        move.hbm_id,
                        move.dram_id,
                        move.table,
                        move.content,  # indexed in DRAM once copied, as the sync would be
                    )
                )
            else:
                kept.append(move)
        self._syncs = kept

    def forget(self, request_id: str) -> None:
        """Drop the request's queued copies (it was freed); those in flight still complete."""
        self._urgent = deque(m for m in self._urgent if m.request_id != request_id)
        self._syncs = deque(m for m in self._syncs if m.request_id != request_id)

    def release_hbm(self, block_id: int) -> None:
        self._hbm.release(block_id)

    def release_dram(self, block_id: int) -> None:
        self._dram.release(block_id)

    def issue(self, budget: int) -> None:
        """Issue up to ``budget`` queued copies (rotation first, then eager syncs) as one
        submit."""
        moves: list[Move] = []
        while budget and self._urgent:
            moves.append(self._urgent.popleft())
            budget -= 1
        while budget and self._syncs:
            moves.append(self._syncs.popleft())
            budget -= 1
        self.stats.per_iteration_blocks.append(len(moves))
        if not moves:
            return
        if self.transfer is None:  # nothing is ever queued without a DRAM tier
            raise RuntimeError(f"{len(moves)} copies queued without a transfer engine")
        self.stats.max_blocks_per_iteration = max(self.stats.max_blocks_per_iteration, len(moves))
        h2d = [BlockCopy(m.dram_id, m.hbm_id) for m in moves if m.kind == LOAD]
        d2h = [BlockCopy(m.hbm_id, m.dram_id) for m in moves if m.kind != LOAD]
        for move in moves:
            self._hbm.copy_started(move.hbm_id)
            self._dram.copy_started(move.dram_id)
        handles = [h for h in self.transfer.submit(h2d, d2h) if h is not None]
        self._in_flight.append(_Batch(moves, handles, time.perf_counter()))
        self.stats.num_batches += 1

    def after_compute(self) -> None:
        """The iteration's compute ended: batches not done by now are exposed from now on."""
        now = time.perf_counter()
        for batch in self._in_flight:
            if batch.compute_ended:
                continue
            batch.compute_ended = True
            if batch.done():
                self.stats.num_batches_hidden += 1
            else:
                batch.exposed_from_s = now

    def retire(self) -> list[Move]:
        """The copies of every completed batch (never blocks), their blocks no longer busy."""
        completed: list[Move] = []
        still: list[_Batch] = []
        for batch in self._in_flight:
            if batch.done():
                self._complete(batch)
                completed.extend(batch.moves)
            else:
                still.append(batch)
        self._in_flight = still
        return completed

    def _complete(self, batch: _Batch) -> None:
        if batch.exposed_from_s is not None:  # upper bound: seen at the next retire
            self.stats.exposed_transfer_s += time.perf_counter() - batch.exposed_from_s
        elif not batch.compute_ended:  # completed before any compute overlapped it
            self.stats.num_batches_hidden += 1
        for move in batch.moves:
            self._hbm.copy_done(move.hbm_id)
            self._dram.copy_done(move.dram_id)

    def wait_for_progress(self) -> None:
        """Block until the oldest batch in flight is done."""
        if self._in_flight:
            for handle in self._in_flight[0].handles:
                handle.wait()

    def wait_all(self) -> None:
        for batch in self._in_flight:
            for handle in batch.handles:
                handle.wait()

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
