"""Garbage collection between iterations: automatic collection is off inside, due collections
run when the service asks, and collection comes back on at the outermost exit."""

from __future__ import annotations

import asyncio
import gc

import pytest

from shared import runtime
from shared.runtime import collect_due_garbage, garbage_collected_between_iterations


class Cycle:
    def __init__(self) -> None:
        self.me = self


def _make_cycles(num: int) -> None:
    for _ in range(num):
        Cycle()


def test_due_collections_run_only_when_asked() -> None:
    assert gc.isenabled()
    with garbage_collected_between_iterations():
        assert not gc.isenabled()
        threshold = gc.get_threshold()[0]
        before = sum(isinstance(o, Cycle) for o in gc.get_objects())
        _make_cycles(3 * threshold)  # automatic collection would have freed most by now
        assert sum(isinstance(o, Cycle) for o in gc.get_objects()) - before >= 3 * threshold
        collect_due_garbage()
        assert gc.get_count()[0] < threshold
        assert not any(isinstance(o, Cycle) for o in gc.get_objects())
        _make_cycles(threshold // 10)  # not due: nothing collected
        collect_due_garbage()
        assert sum(isinstance(o, Cycle) for o in gc.get_objects()) == threshold // 10
    assert gc.isenabled()
    gc.collect()


def _due_passes(num: int) -> list[int]:
    """The generations collected over ``num`` due moments."""
    generations: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(record)
    try:
        for _ in range(num):
            _make_cycles(gc.get_threshold()[0])
            collect_due_garbage()
    finally:
        gc.callbacks.remove(record)
    return generations


def test_older_generations_are_collected_when_their_count_is_due() -> None:
    with garbage_collected_between_iterations():
        threshold1 = gc.get_threshold()[1]
        generations = _due_passes(threshold1 + 1)
    assert len(generations) == threshold1 + 1  # one pass per due moment, no more
    assert max(generations) == 1  # every threshold1-th pass takes generation 1 along


def test_full_passes_wait_for_their_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    _, threshold1, threshold2 = gc.get_threshold()
    enough = (threshold1 + 1) * (threshold2 + 1)  # a full pass is due well before this
    with garbage_collected_between_iterations():
        assert 2 not in _due_passes(enough)  # entered just now: generation 1 instead
        monkeypatch.setattr(runtime, "MIN_FULL_PASS_INTERVAL_S", 0.0)
        assert 2 in _due_passes(enough)


async def test_services_side_by_side_share_it_until_the_last_leaves() -> None:
    both_in, first_left = asyncio.Event(), asyncio.Event()
    seen: list[tuple[bool, int]] = []

    async def first() -> None:  # enters first, leaves first
        with garbage_collected_between_iterations():
            await both_in.wait()
        first_left.set()

    async def second() -> None:
        with garbage_collected_between_iterations():
            both_in.set()
            await first_left.wait()
            seen.append((gc.isenabled(), gc.get_freeze_count()))

    await asyncio.gather(first(), second())
    assert seen == [(False, seen[0][1])] and seen[0][1] > 0  # still paced for the second
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_nesting_turns_collection_back_on_at_the_outermost_exit() -> None:
    with garbage_collected_between_iterations():
        assert gc.get_freeze_count() > 0  # the start-up heap
        with garbage_collected_between_iterations():
            assert not gc.isenabled()
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
