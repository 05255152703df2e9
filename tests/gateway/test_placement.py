"""gateway/placement.py: what a request takes from the router's queue counts and its key's
limits is given back exactly once, whatever order the first token, a move and the end come in
(the real WorkerDirectory and KeyLimiter; the directory's Redis is never touched here)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import APIError
from gateway.inflight import InFlight, InFlightRequests, Route
from gateway.limits import KeyLimiter
from gateway.placement import Placement
from gateway.settings import GatewaySettings
from gateway.workers import WorkerDirectory


def _parts() -> tuple[WorkerDirectory, KeyLimiter]:
    redis: Any = None
    return WorkerDirectory(redis, GatewaySettings(admin_disabled=True)), KeyLimiter(2, 100.0)


def _queued(directory: WorkerDirectory, worker_id: str) -> tuple[int, int]:
    share = directory.queued.get(worker_id)
    return (0, 0) if share is None else (share.num_requests, share.num_prompt_tokens)


def _record(placement: Placement, request_id: str, worker_id: str) -> InFlight:
    return InFlight(request_id, Route(worker_id, "e1", request_id), placement, 8, 0.0)


def test_counted_where_routed_moved_with_the_request_released_once() -> None:
    directory, keys = _parts()
    live = InFlightRequests()
    record = _record(Placement(directory, keys, "w0", 100, "key-1"), "a", "w0")
    other = _record(Placement(directory, keys, "w0", 7, None), "b", "w0")
    live.add(record)
    live.add(other)
    assert _queued(directory, "w0") == (2, 107)
    old = live.reroute(record, record.route.next("w1", "e2", "a"))
    assert old.worker_id == "w0" and record.route == Route("w1", "e2", "a.r2", 2)
    assert live.get("a") is None and live.get("a.r2") is record  # one step, one index
    assert _queued(directory, "w0") == (1, 7) and _queued(directory, "w1") == (1, 100)
    record.started()
    record.started()  # a second first-token report changes nothing
    assert _queued(directory, "w1") == (0, 0) and _queued(directory, "w0") == (1, 7)
    assert live.release(record) and not live.release(record)
    assert _queued(directory, "w0") == (1, 7)  # the other request is still counted
    live.release(other)
    assert _queued(directory, "w0") == (0, 0) and len(live) == 0


def test_a_move_after_the_end_counts_nothing() -> None:
    """The client left while its request was being moved: nothing is left counted anywhere
    (before, the old worker kept the count and the new one lost one it never had)."""
    directory, keys = _parts()
    live = InFlightRequests()
    record = _record(Placement(directory, keys, "w0", 50, None), "a", "w0")
    live.add(record)
    live.release(record)
    live.reroute(record, record.route.next("w1", "e1", "a"))
    assert _queued(directory, "w0") == (0, 0) and _queued(directory, "w1") == (0, 0)
    assert live.get("a.r2") is None  # a released record is not indexed again


def test_the_key_slot_is_given_back_once() -> None:
    directory, keys = _parts()
    first = Placement(directory, keys, "w0", 1, "k")
    Placement(directory, keys, "w0", 1, "k")
    with pytest.raises(APIError) as refused:  # two concurrent requests per key
        Placement(directory, keys, "w0", 1, "k")
    assert refused.value.status_code == 429
    assert _queued(directory, "w0") == (2, 2)  # a refused request takes nothing
    first.release("w0")
    first.release("w0")  # released twice, it must free one slot only
    Placement(directory, keys, "w0", 1, "k")
    with pytest.raises(APIError):
        Placement(directory, keys, "w0", 1, "k")
