"""Largest-VLT-First (SUPERINFER.md §4) over a :class:`ColumnarSnapshot`, with numpy.

The same plan as :func:`shared.policy.lvf.lvf` on the same requests, bit for bit (a property
test holds the two together): VLT for every request as one array, L's order from a stable
``lexsort`` (VLT, then arrival time, then arrival order, then snapshot order), the head scan as
vectorised rounds (:func:`~shared.policy.packing.greedy_take`); Python only touches the
requests the tail scan rotates out and the prefill chunks of the batch. This is the control
plane's path: its snapshots arrive as columns and never become per-request objects.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from shared.policy.columns import (
    ROTARY_CODE,
    RUNNING_CODE,
    ColumnarSnapshot,
    Ints,
    RequestColumns,
    pick_ids,
)
from shared.policy.common import make_chunks
from shared.policy.packing import greedy_take, pack_columns
from shared.policy.types import Knobs, Plan
from shared.policy.vlt import vlt_array

_EMPTY = np.empty(0, np.int64)
_SEGMENT = 256  # the scans rank this many of the most extreme VLTs first


class Transitions(NamedTuple):
    """An LVF plan as row indices into the snapshot's columns: what the control plane turns
    into handles without making an id string. ``batch``/``tokens``: the packed batch, in
    batch order, and each row's tokens (see ``with_batch``)."""

    preempt: Ints
    rotate_out: Ints
    resume: Ints
    admit: Ints
    batch: Ints
    tokens: list[int]
    fcfs_fallback: bool


def lvf_columnar(snapshot: ColumnarSnapshot, knobs: Knobs) -> Plan:
    """:func:`shared.policy.lvf.lvf` over columns."""
    moves = lvf_transitions(snapshot, knobs)
    ids = snapshot.requests.request_ids
    return Plan(
        schedule=make_chunks(pick_ids(ids, moves.batch), moves.tokens),
        admit_ids=pick_ids(ids, moves.admit),
        resume_ids=pick_ids(ids, moves.resume),
        rotate_out_ids=pick_ids(ids, moves.rotate_out),
        preempt_ids=pick_ids(ids, moves.preempt),
        fcfs_fallback=moves.fcfs_fallback,
    )


def lvf_transitions(
    snapshot: ColumnarSnapshot, knobs: Knobs, with_batch: bool = True
) -> Transitions:
    """:func:`lvf_columnar`'s plan, as row indices. ``with_batch`` False (the control plane,
    which sends transitions only) packs the batch only when it decides who joins, and
    otherwise leaves ``batch`` and ``tokens`` empty."""
    columns = snapshot.requests
    bs = snapshot.block_size
    is_running = columns.states == RUNNING_CODE
    running = np.flatnonzero(is_running)
    candidates = np.flatnonzero(~is_running)
    blk = -(-columns.num_tokens // bs)  # blk(r) of every waiting or rotary request
    b_hbm = snapshot.num_free_hbm_blocks - _growth(snapshot, running)
    leaving = (_EMPTY, _EMPTY)
    fcfs_fallback = b_hbm >= int(blk[candidates].sum())
    if fcfs_fallback:  # step 1: no contention
        seats = max(0, snapshot.max_num_seqs - len(running))
        arrival = np.lexsort((columns.arrival_seq[candidates], columns.t_arr_s[candidates]))
        chosen = candidates[arrival[:seats]]
    else:
        scores = vlt_array(columns, snapshot.t_now_s, knobs)
        b_xfer = snapshot.b_xfer_blocks
        seats = snapshot.max_num_seqs - len(running)
        chosen, b_left = _head_scan(snapshot, candidates, scores, blk, b_hbm + b_xfer, seats)
        if b_xfer - b_left > 0:
            b_swap = b_xfer - b_left
            leaving = _rotate_out_tail(snapshot, running, scores, b_swap, -b_hbm, knobs)
    return _join_and_pack(snapshot, running, chosen, blk, leaving, b_hbm, fcfs_fallback, with_batch)


def _growth(snapshot: ColumnarSnapshot, running: Ints) -> int:
    """New HBM blocks the running requests need for their next chunks."""
    columns = snapshot.requests
    computed = columns.num_computed_tokens[running]
    num_new = np.minimum(columns.num_tokens[running] - computed, snapshot.max_num_batched_tokens)
    need = -(-(computed + num_new) // snapshot.block_size) - columns.num_blocks_hbm[running]
    return int(need[need > 0].sum())


def _head_scan(
    snapshot: ColumnarSnapshot,
    candidates: Ints,
    scores: np.ndarray,
    blk: Ints,
    b_left: int,
    seats: int,
) -> tuple[Ints, int]:
    """Step 3 (``shared.policy.lvf._head_scan``): the waiting/rotary requests taken from the
    head of L (indices, in L's order), and B_left."""
    chosen: list[Ints] = []
    if seats <= 0 or b_left <= 0:
        return _EMPTY, b_left
    columns = snapshot.requests
    for segment in _segments_of_l(columns, candidates, scores, True, _SEGMENT):
        segment = segment[columns.num_blocks_hbm[segment] == 0]  # else a rotate-out in flight
        taken, b_left = greedy_take(blk[segment], b_left, seats, stop_at_zero=True)
        chosen.append(segment[taken])
        seats -= len(taken)
        if seats <= 0 or b_left <= 0:
            break
    return np.concatenate(chosen) if len(chosen) > 1 else chosen[0], b_left


def _segments_of_l(
    columns: RequestColumns, indices: Ints, scores: np.ndarray, head: bool, size: int
) -> Iterator[Ints]:
    """``indices`` in L's order (``head``: VLT descending, then arrival time, arrival order,
    snapshot order) or in the tail scan's (VLT ascending, later arrival first, snapshot
    order), as consecutive segments: the (at most) ``size`` most extreme VLTs first, then,
    only if the scan gets that far, the rest. Equal VLTs never straddle the cut (it lies
    strictly between VLT values), so the segments joined are the full order."""
    if len(indices) > 2 * size:
        scan_keys = -scores[indices] if head else scores[indices]  # ascending = scan order
        cut = np.partition(scan_keys, size)[size]
        first = scan_keys < cut
        yield _in_scan_order(columns, indices[first], scores, head)
        indices = indices[~first]
    yield _in_scan_order(columns, indices, scores, head)


def _in_scan_order(columns: RequestColumns, indices: Ints, scores: np.ndarray, head: bool) -> Ints:
    seq, t_arr, score = columns.arrival_seq[indices], columns.t_arr_s[indices], scores[indices]
    keys = (seq, t_arr, -score) if head else (-seq, -t_arr, score)
    return indices[np.lexsort(keys)]  # stable: snapshot order breaks the remaining ties


def _rotate_out_tail(
    snapshot: ColumnarSnapshot,
    running: Ints,
    scores: np.ndarray,
    b_swap: int,
    shortage: int,
    knobs: Knobs,
) -> tuple[Ints, Ints]:
    """Step 4 (``shared.policy.lvf._rotate_out_tail``): from the tail of L (VLT ascending,
    later arrival first) while VLT < 0 and B_swap > 0. Returns (rotated out, preempted)."""
    columns = snapshot.requests
    all_running, initial_shortage = running, shortage
    held = columns.num_blocks_hbm[running]
    # passed over for good: VLT >= 0 (the scan stops there), no HBM block, KV not resident
    running = running[(scores[running] < 0) & (held > 0) & columns.resident[running]]
    victims: list[Ints] = [_EMPTY]
    num_forced = 0  # victims taken while HBM was short (a prefix of the victims)
    held = columns.num_blocks_hbm[running]
    expected = 2 * b_swap * len(held) // max(1, int(held.sum()))  # victims, on average x2
    for segment in _segments_of_l(columns, running, scores, False, max(_SEGMENT, expected)):
        settled = scores[segment] < -knobs.min_residency_s
        taken, num_blocks, forced = _tail_victims(columns, segment, b_swap, shortage, settled)
        num_forced += forced
        victims.append(taken)
        b_swap, shortage = b_swap - num_blocks, shortage - num_blocks
        if b_swap <= 0:
            break
    rotated, no_room = _split_by_dram_room(snapshot, np.concatenate(victims), num_forced)
    if not len(no_room):
        return rotated, _EMPTY
    uncovered = initial_shortage - int(columns.num_blocks_hbm[rotated].sum())
    return rotated, _recompute_newest(columns, all_running, rotated, uncovered)


def _recompute_newest(columns: RequestColumns, running: Ints, rotated: Ints, shortage: int) -> Ints:
    """``shared.policy.lvf._recompute_newest``: from the end of the running list, the
    requests to preempt by recompute until ``shortage`` blocks are freed."""
    if shortage <= 0:
        return _EMPTY
    leaves = np.zeros(len(columns), np.bool_)
    leaves[rotated] = True
    newest_first = running[::-1]
    newest_first = newest_first[~leaves[newest_first] & columns.resident[newest_first]]
    held = columns.num_blocks_hbm[newest_first]
    newest_first, held = newest_first[held > 0], held[held > 0]
    count = int(np.searchsorted(np.cumsum(held) - held, shortage, side="left"))
    return newest_first[:count]


def _tail_victims(
    columns: RequestColumns, order: Ints, b_swap: int, shortage: int, settled: np.ndarray
) -> tuple[Ints, int, int]:
    """The victims among ``order`` (in scan order), their blocks, and how many of them were
    taken while the shortage lasted. Each takes its blocks off both B_swap and the shortage,
    so they are a prefix of the scan while the shortage lasts (unserved requests may go
    then), and after it a prefix of the served rest."""
    held = columns.num_blocks_hbm[order]
    before = np.cumsum(held) - held  # blocks the scan took before each row, were all taken
    num_forced = 0
    if shortage > 0:
        num_forced = int(np.searchsorted(before, min(shortage, b_swap), side="left"))
    victims = order[:num_forced]
    used = int(held[:num_forced].sum())
    if used < b_swap and num_forced < len(order):
        t_last, t_run = columns.t_last_s[order], columns.t_run_s[order]
        served = ~np.isnan(t_last) & (np.isnan(t_run) | (t_last >= t_run)) & settled
        served[:num_forced] = False
        rest, rest_held = order[served], held[served]
        count = int(np.searchsorted(used + np.cumsum(rest_held) - rest_held, b_swap, "left"))
        victims = np.concatenate((victims, rest[:count]))
        used += int(rest_held[:count].sum())
    return victims, used, num_forced


def _split_by_dram_room(
    snapshot: ColumnarSnapshot, victims: Ints, num_forced: int
) -> tuple[Ints, Ints]:
    """In scan order: (victims DRAM has room for, to rotate out; the forced ones, among
    the first ``num_forced`` taken while HBM was short, it has no room for)."""
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


def _join_and_pack(
    snapshot: ColumnarSnapshot,
    running: Ints,
    chosen: Ints,
    blk: Ints,
    leaving: tuple[Ints, Ints],
    room: int,
    fcfs_fallback: bool,
    with_batch: bool,
) -> Transitions:
    """``shared.policy.lvf._join_and_pack``: resume the chosen rotary requests whose blocks
    fit in what is left of B_HBM (and whose rotate-out is done), let the chosen waiting ones
    whose whole KV fits it join the batch (up to the first rotary request waiting for room),
    pack it, admit the joining requests that got a chunk."""
    columns = snapshot.requests
    rotated, preempted = leaving
    free = snapshot.num_free_hbm_blocks
    if len(preempted):
        freed = int(columns.num_blocks_hbm[preempted].sum())
        free, room = free + freed, room + freed
        chosen = _EMPTY  # as in vLLM, a step that preempted by recompute lets nobody in
    is_rotary = columns.states[chosen] == ROTARY_CODE
    can_act = ~is_rotary | (columns.num_blocks_hbm[chosen] == 0)
    acting = np.flatnonzero(can_act)
    fitted, _ = greedy_take(blk[chosen[acting]], room, len(acting), stop_at_zero=False)
    taken = np.zeros(len(acting), np.bool_)
    taken[fitted] = True
    blocked = np.flatnonzero(is_rotary[acting] & ~taken)  # rotary requests waiting for room
    cut = int(acting[blocked[0]]) if len(blocked) else len(chosen)  # the first holds the rest
    taken[acting >= cut] = False
    resumed = chosen[acting[taken & is_rotary[acting]]]
    free -= int(blk[resumed].sum())
    joining = chosen[acting[taken & ~is_rotary[acting]]]  # whole KV fits the room
    if not len(joining) and not with_batch:  # nobody whose admission the batch decides
        return Transitions(preempted, rotated, resumed, _EMPTY, _EMPTY, [], fcfs_fallback)
    keep = running
    if len(rotated) or len(preempted):
        leaves = np.zeros(len(columns), np.bool_)
        leaves[rotated] = leaves[preempted] = True
        keep = running[~leaves[running]]
    batch, tokens = pack_columns(
        columns,
        np.concatenate((keep, joining)),
        snapshot.block_size,
        snapshot.max_num_batched_tokens,
        snapshot.max_num_seqs,
        max(0, free),
    )
    admitted = _EMPTY
    if len(joining):
        scheduled = np.zeros(len(columns), np.bool_)
        scheduled[batch] = True
        admitted = joining[scheduled[joining]]
    return Transitions(preempted, rotated, resumed, admitted, batch, tokens, fcfs_fallback)
