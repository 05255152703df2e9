"""Arithmetic every policy shares: block counts and packing a running set into one batch.

Block accounting follows the engine (data_plane/engine/engine.py): it applies a plan's
preemptions first (their HBM blocks are free at once), then rotations out (their HBM blocks
stay taken until the D2H copy completes, so they are *not* free this iteration), then resumes
(each allocates the HBM blocks its KV is copied into) and admissions, and only then allocates
the blocks of the scheduled chunks, in schedule order.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

from shared.policy.types import RequestState, RequestView, ScheduledChunk, Snapshot


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def num_pending_tokens(view: RequestView) -> int:
    """Tokens whose KV the request still has to compute (1 for a decode)."""
    return view.num_tokens - view.num_computed_tokens


def is_decode(view: RequestView) -> bool:
    return view.num_computed_tokens > 0 and num_pending_tokens(view) == 1


def demand_blocks(view: RequestView, block_size: int) -> int:
    """blk(r): the HBM blocks ``view`` needs to run (SUPERINFER.md §4). For a rotary request
    this is also an upper bound on what resuming it allocates in HBM."""
    if view.state is RequestState.RUNNING:
        return view.num_blocks_hbm
    if view.state is RequestState.WAITING:  # cached prefix blocks in use are shared, not new
        return blocks_for(view.num_tokens, block_size) - view.num_blocks_hbm
    return blocks_for(view.num_tokens, block_size)


def growth_blocks(view: RequestView, snapshot: Snapshot) -> int:
    """New HBM blocks a running request needs for its next chunk."""
    num_new = min(num_pending_tokens(view), snapshot.max_num_batched_tokens)
    need = blocks_for(view.num_computed_tokens + num_new, snapshot.block_size)
    return max(0, need - view.num_blocks_hbm)


def split_snapshot(
    snapshot: Snapshot,
) -> tuple[list[RequestView], list[RequestView], list[RequestView]]:
    """(running, waiting, rotary) in snapshot order: slices when the snapshot says how its
    requests are grouped (``partition``), else one pass over them."""
    if snapshot.partition is None:
        return split_by_state(snapshot.requests)
    num_running, num_waiting = snapshot.partition
    requests = snapshot.requests
    split = num_running + num_waiting
    return list(requests[:num_running]), list(requests[num_running:split]), list(requests[split:])


def split_by_state(
    views: Iterable[RequestView],
) -> tuple[list[RequestView], list[RequestView], list[RequestView]]:
    running: list[RequestView] = []
    waiting: list[RequestView] = []
    rotary: list[RequestView] = []
    for view in views:
        if view.state is RequestState.RUNNING:
            running.append(view)
        elif view.state is RequestState.WAITING:
            waiting.append(view)
        else:
            rotary.append(view)
    return running, waiting, rotary


def arrival_key(view: RequestView) -> tuple[float, int]:
    """First come, first served: arrival time, then arrival order."""
    return (view.t_arr_s, view.arrival_seq)


_new_tuple = tuple.__new__


def make_chunk(request_id: str, num_tokens: int) -> ScheduledChunk:
    """``ScheduledChunk(request_id, num_tokens)`` without the Python-level ``__new__`` of a
    named tuple. A batch of thousands of decodes is built every iteration."""
    return _new_tuple(ScheduledChunk, (request_id, num_tokens))


def make_chunks(request_ids: Iterable[str], num_tokens: Iterable[int]) -> list[ScheduledChunk]:
    """``[make_chunk(r, n) for r, n in zip(request_ids, num_tokens)]``, all in C."""
    return list(map(_new_tuple, repeat(ScheduledChunk), zip(request_ids, num_tokens, strict=True)))


def pack_schedule(
    views: list[RequestView], snapshot: Snapshot, num_free_blocks: int
) -> list[ScheduledChunk]:
    """Pack a running set into one batch: decodes first, then prefill chunks, each group in the
    given order, within the token budget, ``max_num_seqs`` and ``num_free_blocks`` new blocks.

    A prefill chunk shrinks to the tokens its blocks can hold; a request that cannot get a
    single token in is skipped (the rest are still tried). Requests whose KV is not resident
    yet (an H2D copy in flight) sit this iteration out.
    """
    bs = snapshot.block_size
    budget = snapshot.max_num_batched_tokens
    seats = snapshot.max_num_seqs
    schedule: list[ScheduledChunk] = []
    prefills: list[RequestView] = []
    add, new = schedule.append, _new_tuple
    for view in views:  # decodes: one token each, a new block at a block boundary
        computed = view.num_computed_tokens
        pending = view.num_tokens - computed
        if pending != 1 or computed <= 0:
            if pending > 0:
                prefills.append(view)
            continue
        if seats <= 0 or budget <= 0:
            return schedule
        if view.resident:
            grow = computed // bs + 1 - view.num_blocks_hbm
            if grow > 0:
                if grow > num_free_blocks:
                    continue
                num_free_blocks -= grow
            add(new(ScheduledChunk, (view.request_id, 1)))  # make_chunk(view.request_id, 1)
            budget -= 1
            seats -= 1
    for view in prefills:
        if seats <= 0 or budget <= 0:
            break
        computed, held = view.num_computed_tokens, view.num_blocks_hbm
        num_new = min(view.num_tokens - computed, budget, (held + num_free_blocks) * bs - computed)
        if num_new <= 0 or not view.resident:
            continue
        num_free_blocks -= max(0, -(-(computed + num_new) // bs) - held)
        schedule.append(make_chunk(view.request_id, num_new))
        budget -= num_new
        seats -= 1
    return schedule
