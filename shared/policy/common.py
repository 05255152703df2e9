"""Arithmetic every policy shares: block counts and packing a running set into one batch."""

from __future__ import annotations

from collections.abc import Iterable

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
    """blk(r): the HBM blocks ``view`` needs to run (SUPERINFER.md §4)."""
    if view.state is RequestState.RUNNING:
        return view.num_blocks_hbm
    return blocks_for(view.num_tokens, block_size)


def growth_blocks(view: RequestView, snapshot: Snapshot) -> int:
    """New HBM blocks a running request needs for its next chunk."""
    num_new = min(num_pending_tokens(view), snapshot.max_num_batched_tokens)
    need = blocks_for(view.num_computed_tokens + num_new, snapshot.block_size)
    return max(0, need - view.num_blocks_hbm)


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


def pack_schedule(
    views: list[RequestView], snapshot: Snapshot, num_free_blocks: int
) -> list[ScheduledChunk]:
    """Pack a running set into one batch: decodes first, then prefill chunks, each group in the
    given order, within the token budget, ``max_num_seqs`` and the free HBM blocks.

    Requests whose KV is not resident yet (an H2D copy in flight) sit this iteration out.
    """
    decodes = [v for v in views if is_decode(v)]
    prefills = [v for v in views if not is_decode(v) and num_pending_tokens(v) > 0]
    token_budget = snapshot.max_num_batched_tokens
    schedule: list[ScheduledChunk] = []
    for view in decodes + prefills:
        if len(schedule) >= snapshot.max_num_seqs or token_budget <= 0:
            break
        if not view.resident:
            continue
        num_new = min(num_pending_tokens(view), token_budget)
        capacity = (view.num_blocks_hbm + num_free_blocks) * snapshot.block_size
        num_new = min(num_new, capacity - view.num_computed_tokens)
        if num_new <= 0:
            continue
        need = blocks_for(view.num_computed_tokens + num_new, snapshot.block_size)
        num_free_blocks -= max(0, need - view.num_blocks_hbm)
        token_budget -= num_new
        schedule.append(ScheduledChunk(view.request_id, num_new))
    return schedule
