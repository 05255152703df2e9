"""The waiting queue keeps its views and columns equal to building them from scratch."""

from __future__ import annotations

import random

import numpy as np
import pytest

from data_plane.engine.queues import RequestQueue
from data_plane.engine.request import Request, RequestStatus
from data_plane.engine.sampling import SamplingParams
from shared.policy import RequestState, RequestView, columns_from_views
from shared.policy.columns import FLOAT_FIELDS, INT_FIELDS, RequestColumns, concat_column_arrays
from tests.data_plane.views import view_by_name


def view_of(request: Request) -> RequestView:
    return view_by_name(request, resident=request.arrival_seq % 3 != 0)


def make_request(seq: int, rng: random.Random) -> Request:
    return Request(
        request_id=f"r{seq}",
        prompt_token_ids=[1] * rng.randint(1, 50),
        params=SamplingParams(max_tokens=4),
        t_arr_s=rng.random() * 10,
        arrival_seq=seq,
        priority=rng.randint(-2, 2),
        slo_ttft_s=rng.choice([None, 1.0, 5.0]),
        slo_tbt_s=rng.choice([None, 0.05]),
        t_run_s=rng.choice([None, 3.5]),
        t_last_s=rng.choice([None, 4.25]),
    )


def snapshot_columns(queue: RequestQueue, overrides: dict | None = None) -> RequestColumns:
    """The queue's columns as the engine's snapshot takes them (copied out of its buffers)."""
    return concat_column_arrays([queue.column_arrays(overrides)])


def assert_same(queue: RequestQueue, reference: list[Request]) -> None:
    assert list(queue) == reference and len(queue) == len(reference)
    expected_views = [view_of(r) for r in reference]
    assert queue.views() == expected_views
    got, expected = snapshot_columns(queue), columns_from_views(expected_views)
    assert list(got.request_ids) == list(expected.request_ids)
    for name in ("states", *INT_FIELDS, "resident"):
        assert np.array_equal(getattr(got, name), getattr(expected, name)), name
    for name in FLOAT_FIELDS:
        assert np.array_equal(getattr(got, name), getattr(expected, name), equal_nan=True), name


@pytest.mark.parametrize("seed", range(5))
def test_random_joins_and_leaves_match_a_rebuilt_queue(seed: int) -> None:
    rng = random.Random(seed)
    queue = RequestQueue(view_of, capacity=2)  # small: growth happens many times
    reference: list[Request] = []
    for seq in range(400):
        action = rng.random()
        if action < 0.45 or not reference:
            request = make_request(seq, rng)
            queue.append(request)
            reference.append(request)
        elif action < 0.6:
            request = make_request(seq, rng)
            queue.appendleft(request)
            reference.insert(0, request)
        else:
            leaving = reference[0] if action < 0.8 else rng.choice(reference)
            queue.remove(leaving)
            reference.remove(leaving)
        if seq % 37 == 0:
            assert_same(queue, reference)
    assert_same(queue, reference)
    for request in list(reference):
        queue.remove(request)
    assert_same(queue, [])
    assert not queue


def test_columns_are_copies_and_bad_input_is_refused() -> None:
    rng = random.Random(0)
    queue = RequestQueue(view_of)
    first = make_request(1, rng)
    queue.append(first)
    columns = snapshot_columns(queue)
    queue.appendleft(make_request(2, rng))
    assert columns.arrival_seq.tolist() == [1]  # a snapshot taken earlier does not change
    with pytest.raises(ValueError, match="not waiting here"):
        queue.remove(make_request(3, rng))
    running = make_request(4, rng)
    running.status = RequestStatus.RUNNING
    with pytest.raises(ValueError, match="running, not waiting"):
        queue.append(running)


def test_a_rotary_queue_codes_its_state_and_takes_fresh_counts() -> None:
    rng = random.Random(1)
    queue = RequestQueue(view_of, RequestState.ROTARY)
    requests = [make_request(seq, rng) for seq in range(3)]
    for request in requests:
        request.status = RequestStatus.ROTARY
        queue.append(request)
    fresh = np.array([5, 0, 7], np.int64)
    columns = snapshot_columns(queue, {"num_blocks_hbm": fresh})
    assert columns.states.tolist() == [2, 2, 2]  # ROTARY_CODE
    assert columns.num_blocks_hbm.tolist() == [5, 0, 7]
    assert columns.arrival_seq.tolist() == [0, 1, 2]
    waiting = make_request(9, rng)
    with pytest.raises(ValueError, match="waiting, not rotary"):
        queue.append(waiting)
