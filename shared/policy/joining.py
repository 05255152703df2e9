"""Block and seat accounting of the policies: blk(r) (:func:`candidate_blocks`) and the
running requests' growth under one token budget (:func:`running_growth`), the product's one
of each; and, for LVF (shared/policy/lvf.py) and fitting a remote plan
(shared/policy/remote.py), DRAM room for victims, recompute cover for a shortage, and who
joins the batch with the room left.

Block accounting follows the engine (data_plane/engine/engine.py): it applies a plan's
preemptions first (their HBM blocks are free at once), then rotations out (a victim's synced
HBM blocks are dropped at once, its unsynced ones come free only when their D2H copy
completes: ``TieredKVCacheManager.rotate_out``), then resumes (each allocates the HBM blocks
its KV is copied into) and admissions, and only then allocates the blocks of the scheduled
chunks, in schedule order.
"""

from __future__ import annotations

from typing import Any, NamedTuple, overload

import numpy as np
import numpy.typing as npt

from shared.policy.columns import (
    ROTARY_CODE,
    WAITING_CODE,
    ColumnarSnapshot,
    Ints,
    RequestColumns,
)
from shared.policy.packing import greedy_take, pack_columns
from shared.policy.types import Knobs
from shared.policy.vlt import prefills_by_deadline

EMPTY = np.empty(0, np.int64)
Bools = npt.NDArray[np.bool_]


class Transitions(NamedTuple):
    """A plan as row indices into the snapshot's columns: what the control plane turns into
    handles without making an id string. ``batch``/``tokens``: the packed batch, in batch
    order, and each row's tokens (empty when not asked for)."""

    preempt: Ints
    rotate_out: Ints
    resume: Ints
    admit: Ints
    batch: Ints
    tokens: list[int]
    fcfs_fallback: bool


@overload
def candidate_blocks(
    num_tokens: int, num_blocks_hbm: int, waiting: bool, block_size: int
) -> int: ...


@overload
def candidate_blocks(
    num_tokens: Ints, num_blocks_hbm: Ints, waiting: Bools, block_size: int
) -> Ints: ...


def candidate_blocks(num_tokens: Any, num_blocks_hbm: Any, waiting: Any, block_size: int) -> Any:
    """blk(r) (SUPERINFER.md §4) of a waiting or rotary request, on ints or element-wise on
    columns: the HBM blocks its whole KV needs, less, for a waiting request, the blocks of its
    cached prefix already in HBM and in use (shared, not allocated; a cached block nobody uses
    is counted: it is among the free). The one blk(r) of the product."""
    return -(-num_tokens // block_size) - num_blocks_hbm * waiting


def running_growth(snapshot: ColumnarSnapshot, running: Ints) -> Ints:
    """New HBM blocks each running request needs for this step's batch, in ``running``'s
    order: a decode one block at a block boundary; the prefills share what the decodes leave
    of ``max_num_batched_tokens`` (and of the seats), in running order, as the batch packs
    them. Requests whose KV is still arriving compute nothing this step."""
    columns, bs = snapshot.requests, snapshot.block_size
    computed = columns.num_computed_tokens[running]
    held = columns.num_blocks_hbm[running]
    pending = columns.num_tokens[running] - computed
    resident = columns.resident[running]
    is_decode = (pending == 1) & (computed > 0) & resident
    num_tokens = np.where(is_decode, 1, 0)
    prefill = np.flatnonzero(~is_decode & (pending > 0) & resident)
    budget = max(0, snapshot.max_num_batched_tokens - int(is_decode.sum()))
    seats = max(0, snapshot.max_num_seqs - int(is_decode.sum()))
    if len(prefill) and budget and seats:
        prefill = prefill[:seats]
        wanted = pending[prefill]
        if snapshot.long_prefill_token_threshold > 0:
            wanted = np.minimum(wanted, snapshot.long_prefill_token_threshold)
        before = np.cumsum(wanted) - wanted
        num_tokens[prefill] = np.clip(budget - before, 0, wanted)
    need = -(-(computed + num_tokens) // bs) - held
    return np.where(num_tokens > 0, np.maximum(need, 0), 0)


def split_by_dram_room(
    snapshot: ColumnarSnapshot, victims: Ints, num_forced: int
) -> tuple[Ints, Ints]:
    """In scan order: (victims DRAM has room for, to rotate out; the forced ones, among the
    first ``num_forced``, it has no room for). A victim needs DRAM for its blocks without a
    DRAM twin; one that does not fit stays running unless it was forced."""
    columns = snapshot.requests
    dram_needed = columns.num_blocks_hbm[victims] - columns.num_blocks_dram[victims]
    free_dram = snapshot.num_free_dram_blocks
    if free_dram >= 0:  # then "needs <= free" is "max(0, needs) <= free": a greedy scan
        fits, _ = greedy_take(np.maximum(dram_needed, 0), free_dram, len(victims), False)
    else:  # a negative free count only lets through victims with a surplus of synced blocks
        fits = np.flatnonzero(dram_needed <= free_dram)
    rotates = np.zeros(len(victims), np.bool_)
    rotates[fits] = True
    preempts = ~rotates
    preempts[num_forced:] = False
    return victims[rotates], victims[preempts]


def recompute_newest(columns: RequestColumns, running: Ints, rotated: Ints, shortage: int) -> Ints:
    """From the end of ``running`` (the newest, as vLLM V1's ``running.pop()``; LVF gives it
    by priority band, the worst last), the requests to preempt by recompute until ``shortage``
    blocks are freed; passed over: requests rotating out, holding no HBM block, or whose KV
    is still arriving."""
    if shortage <= 0:
        return EMPTY
    leaves = np.zeros(len(columns), np.bool_)
    leaves[rotated] = True
    newest_first = running[::-1]
    newest_first = newest_first[~leaves[newest_first] & columns.resident[newest_first]]
    held = columns.num_blocks_hbm[newest_first]
    newest_first, held = newest_first[held > 0], held[held > 0]
    count = int(np.searchsorted(np.cumsum(held) - held, shortage, side="left"))
    return newest_first[:count]


def freed_at_once(columns: RequestColumns, victims: Ints) -> int:
    """HBM blocks the victims' rotations free in this iteration: those with a DRAM twin
    (synced, or syncing: an estimate; the engine un-admits a request whose chunk finds no
    block)."""
    if not len(victims):
        return 0
    held = columns.num_blocks_hbm[victims]
    return int(np.minimum(held, np.maximum(columns.num_blocks_dram[victims], 0)).sum())


def join_and_pack(
    snapshot: ColumnarSnapshot,
    running: Ints,
    growth: Ints,
    chosen: Ints,
    leaving: tuple[Ints, Ints],
    fcfs_fallback: bool,
    knobs: Knobs,
    with_batch: bool,
) -> Transitions:
    """Act on the ``chosen`` requests (in rank order) with the room the ``leaving`` ones
    (rotated out, preempted) leave, then pack the batch.

    Room = free HBM + blocks freed in this iteration - the remaining running requests'
    growth. A chosen rotary request resumes if its blocks fit the room left (and its own
    rotate-out is done); with ``hold_room_for_rotary`` one that does not fit stops everyone
    ranked below it from acting. A chosen waiting request starts only if its whole KV,
    blk(r), fits the room left, and is admitted only if it gets a chunk in the batch.
    Seats: the free ones plus one per leaving request. Nobody joins in a step that preempted
    by recompute (vLLM's rule: the freed blocks are the growth's).
    """
    columns, bs = snapshot.requests, snapshot.block_size
    rotated, preempted = leaving
    credit = np.zeros(len(columns), np.int64)
    credit[running] = growth
    leavers = np.concatenate((rotated, preempted))
    freed = freed_at_once(columns, rotated) + int(columns.num_blocks_hbm[preempted].sum())
    free = snapshot.num_free_hbm_blocks + freed
    room = free - int(growth.sum()) + int(credit[leavers].sum())
    seats = snapshot.max_num_seqs - len(running) + len(leavers)
    if len(preempted):
        chosen = EMPTY
    waiting = columns.states[chosen] == WAITING_CODE
    blk = candidate_blocks(columns.num_tokens[chosen], columns.num_blocks_hbm[chosen], waiting, bs)
    is_rotary = columns.states[chosen] == ROTARY_CODE
    acting = np.flatnonzero(~is_rotary | (columns.num_blocks_hbm[chosen] == 0))
    fitted, _ = greedy_take(blk[acting], room, max(0, seats), stop_at_zero=False)
    taken = np.zeros(len(acting), np.bool_)
    taken[fitted] = True
    if knobs.hold_room_for_rotary:
        blocked = np.flatnonzero(is_rotary[acting] & ~taken)
        if len(blocked):
            taken[acting >= acting[blocked[0]]] = False
    resumed = chosen[acting[taken & is_rotary[acting]]]
    free -= int(blk[acting[taken & is_rotary[acting]]].sum())
    joining = chosen[acting[taken & ~is_rotary[acting]]]
    if not len(joining) and not with_batch:
        return Transitions(preempted, rotated, resumed, EMPTY, EMPTY, [], fcfs_fallback)
    keep = running
    if len(leavers):
        leaves = np.zeros(len(columns), np.bool_)
        leaves[leavers] = True
        keep = running[~leaves[running]]
    batch, tokens = pack_columns(
        columns,
        prefills_by_deadline(columns, np.concatenate((keep, joining)), knobs, snapshot.t_now_s),
        bs,
        snapshot.max_num_batched_tokens,
        snapshot.max_num_seqs,
        max(0, free),
        snapshot.long_prefill_token_threshold,
    )
    admitted = EMPTY
    if len(joining):
        scheduled = np.zeros(len(columns), np.bool_)
        scheduled[batch] = True
        admitted = joining[scheduled[joining]]
    return Transitions(preempted, rotated, resumed, admitted, batch, tokens, fcfs_fallback)
