"""Helpers the view-walking policies (shared/policy/vllm.py) share: a request's pending
tokens, splitting a snapshot by state, FCFS order, building batch chunks.

The policy math has one product definition each, over columns (shared/policy/__init__.py
names them): VLT, blk(r), the running requests' growth and batch packing. A view-walking
policy calls them on scalars or on columns built from its views.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

from shared.policy.types import RequestState, RequestView, ScheduledChunk, Snapshot


def num_pending_tokens(view: RequestView) -> int:
    """Tokens whose KV the request still has to compute (1 for a decode)."""
    return view.num_tokens - view.num_computed_tokens


def is_decode(view: RequestView) -> bool:
    return view.num_computed_tokens > 0 and num_pending_tokens(view) == 1


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
