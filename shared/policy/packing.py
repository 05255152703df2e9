"""Column-wise building blocks of the policies: the sequential "take it if it still fits"
scan and batch packing (:func:`pack_columns`, the product's one packing), on numpy arrays.

Both produce exactly what their one-request-at-a-time statements produce (a Python loop over
the items, and ``pack_schedule`` in tests/shared/policy_reference.py; property tests hold
them equal); numpy does the bulk of the work, Python only the few requests where a decision
depends on the ones before.
"""

from __future__ import annotations

import numpy as np

from shared.policy.columns import Ints, RequestColumns

_EMPTY = np.empty(0, np.int64)
_MAX_ROUNDS = 12  # vectorised rounds before the rest is scanned one by one
_SLICE = 64  # prefill rows read into Python at a time


def greedy_take(sizes: Ints, budget: int, max_items: int, stop_at_zero: bool) -> tuple[Ints, int]:
    """Scan ``sizes`` in order and take each item that fits in what is left of ``budget``
    (one that does not fit is skipped, the scan goes on), at most ``max_items`` of them.
    ``stop_at_zero``: the scan also ends once the budget is exactly used up (so later
    zero-size items are not taken). Returns (positions taken, ascending; budget left).

    Each round takes the longest prefix that fits as a whole (a cumulative sum) and drops
    every remaining item larger than what is left, which also drops the item that ended the
    prefix; after a few rounds the remainder is scanned in Python.
    """
    positions = np.arange(len(sizes))
    taken: list[Ints] = []
    for _ in range(_MAX_ROUNDS):
        if max_items <= 0 or not len(positions) or (stop_at_zero and budget <= 0):
            return _joined(taken), budget
        fits = sizes[positions] <= budget
        if not fits.all():
            positions = positions[fits]
            if not len(positions):
                return _joined(taken), budget
        cumulative = np.cumsum(sizes[positions])
        if stop_at_zero:
            count = int(np.searchsorted(cumulative, budget, side="left"))
            if count < len(cumulative) and cumulative[count] == budget:
                count += 1  # this one uses the budget up: the scan ends after it
        else:
            count = int(np.searchsorted(cumulative, budget, side="right"))
        count = min(count, max_items)
        taken.append(positions[:count])
        budget -= int(cumulative[count - 1])
        max_items -= count
        positions = positions[count:]
    rest, budget = _scan(sizes, positions, budget, max_items, stop_at_zero)
    taken.append(rest)
    return _joined(taken), budget


def _scan(
    sizes: Ints, positions: Ints, budget: int, max_items: int, stop_at_zero: bool
) -> tuple[Ints, int]:
    taken: list[int] = []
    for position, size in zip(positions.tolist(), sizes[positions].tolist(), strict=True):
        if max_items <= 0 or (stop_at_zero and budget <= 0):
            break
        if size <= budget:
            taken.append(position)
            budget -= size
            max_items -= 1
    return np.array(taken, dtype=np.int64), budget


def _joined(parts: list[Ints]) -> Ints:
    if not parts:
        return _EMPTY
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def pack_columns(
    columns: RequestColumns,
    order: Ints,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    num_free_blocks: int,
    long_prefill_token_threshold: int = 0,
) -> tuple[Ints, list[int]]:
    """Pack the requests ``order`` (indices into ``columns``) into one batch: decodes first,
    then prefill chunks, each group in ``order``, within the token budget, ``max_num_seqs``
    and ``num_free_blocks`` new blocks. A prefill chunk shrinks to the tokens its blocks can
    hold and to ``long_prefill_token_threshold`` (when > 0: vLLM's cap, so one long prompt
    leaves room for those behind it); a request that cannot get a token in is skipped (the
    rest are still tried); one whose KV is not resident yet sits this iteration out. Returns
    (the scheduled requests' indices, their token counts), in batch order."""
    budget, seats = max_num_batched_tokens, max_num_seqs
    cap = min(seats, budget)
    if cap <= 0 or not len(order):
        return _EMPTY, []
    computed = columns.num_computed_tokens[order]
    pending = columns.num_tokens[order] - computed
    is_decode = (pending == 1) & (computed > 0)
    decodes = order[is_decode]
    scheduled = _EMPTY
    if len(decodes):
        scheduled, num_free_blocks = _pack_decodes(
            columns, decodes, computed[is_decode], block_size, num_free_blocks
        )
        if len(scheduled) >= cap:
            scheduled = scheduled[:cap]
            return scheduled, [1] * len(scheduled)
        seats -= len(scheduled)
        budget -= len(scheduled)
    prefills = order[~is_decode & (pending > 0)]
    room = (budget, seats, num_free_blocks)
    chunk_ids, chunk_tokens = _pack_prefills(
        columns, prefills, block_size, room, long_prefill_token_threshold
    )
    tokens = [1] * len(scheduled) + chunk_tokens
    return np.concatenate((scheduled, np.array(chunk_ids, dtype=np.int64))), tokens


def _pack_decodes(
    columns: RequestColumns, decodes: Ints, computed: Ints, block_size: int, num_free: int
) -> tuple[Ints, int]:
    """The resident decodes that get their one token: those that need no new block, and
    those that do while free blocks last (in order; one that does not fit is skipped)."""
    resident = columns.resident[decodes]
    grow = computed // block_size + 1 - columns.num_blocks_hbm[decodes]
    growing = resident & (grow > 0)
    if not growing.any():
        return decodes[resident], num_free
    growing_at = np.flatnonzero(growing)
    taken, num_free = greedy_take(grow[growing_at], num_free, len(growing_at), False)
    keep = resident & ~growing
    keep[growing_at[taken]] = True
    return decodes[keep], num_free


def _pack_prefills(
    columns: RequestColumns,
    prefills: Ints,
    block_size: int,
    room: tuple[int, int, int],
    max_chunk: int,
) -> tuple[list[int], list[int]]:
    """Prefill chunks in order, each shrunk to what its blocks can hold; a request that gets
    no token (or whose KV is not resident) is skipped. Rows are read into Python in slices
    (the budget usually runs out long before the list does) while blocks are free; once
    none is, the rest is packed column-wise (:func:`_pack_without_free_blocks`). ``room``:
    the token budget, seats and free blocks left; ``max_chunk``: a chunk's cap (0: none)."""
    budget, seats, num_free = room
    cap = max_chunk if max_chunk > 0 else budget
    chunk_ids: list[int] = []
    chunk_tokens: list[int] = []
    start = 0
    while start < len(prefills) and num_free > 0:
        rows = prefills[start : start + _SLICE]
        start += len(rows)
        for at, (index, num_tokens, computed, held, resident) in enumerate(
            zip(
                rows.tolist(),
                columns.num_tokens[rows].tolist(),
                columns.num_computed_tokens[rows].tolist(),
                columns.num_blocks_hbm[rows].tolist(),
                columns.resident[rows].tolist(),
                strict=True,
            )
        ):
            if seats <= 0 or budget <= 0:
                return chunk_ids, chunk_tokens
            if num_free <= 0:
                start += at - len(rows)  # the rest goes column-wise
                break
            num_new = min(
                num_tokens - computed, budget, cap, (held + num_free) * block_size - computed
            )
            if num_new <= 0 or not resident:
                continue
            num_free -= max(0, -(-(computed + num_new) // block_size) - held)
            chunk_ids.append(index)
            chunk_tokens.append(num_new)
            budget -= num_new
            seats -= 1
    if start < len(prefills) and seats > 0 and budget > 0:
        rest_ids, rest_tokens = _pack_without_free_blocks(
            columns, prefills[start:], block_size, budget, seats, cap
        )
        chunk_ids += rest_ids
        chunk_tokens += rest_tokens
    return chunk_ids, chunk_tokens


def _pack_without_free_blocks(
    columns: RequestColumns, prefills: Ints, block_size: int, budget: int, seats: int, cap: int
) -> tuple[list[int], list[int]]:
    """With no free block a prefill gets min(pending, room in its own blocks, ``cap``, budget
    left) tokens and takes no block, so who gets how much follows from a cumulative sum: every
    resident request with room, in order, while seats last and the budget before it is > 0."""
    computed = columns.num_computed_tokens[prefills]
    room = columns.num_blocks_hbm[prefills] * block_size - computed
    usable = (room > 0) & columns.resident[prefills]
    rows = prefills[usable][:seats]
    wanted = np.minimum(columns.num_tokens[rows] - computed[usable][:seats], room[usable][:seats])
    wanted = np.minimum(wanted, cap)
    before = np.cumsum(wanted) - wanted  # budget the rows before each one took
    count = int(np.searchsorted(before, budget, side="left"))
    tokens = np.minimum(wanted[:count], budget - before[:count])
    return rows[:count].tolist(), tokens.tolist()
