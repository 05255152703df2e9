"""Garbage collection between iterations: automatic collection is off inside, due collections
run when the service asks, and collection comes back on at the outermost exit."""

from __future__ import annotations

import gc

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


def test_older_generations_are_collected_when_their_count_is_due() -> None:
    generations: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            generations.append(info["generation"])

    with garbage_collected_between_iterations():
        threshold0, threshold1, _ = gc.get_threshold()
        gc.callbacks.append(record)
        try:
            for _ in range(threshold1 + 1):
                _make_cycles(threshold0)
                collect_due_garbage()
        finally:
            gc.callbacks.remove(record)
    assert generations.count(0) >= threshold1 - 1  # one pass per due moment, no more
    assert len(generations) == threshold1 + 1
    assert max(generations) >= 1  # every threshold1-th pass takes generation 1 along


def test_nesting_turns_collection_back_on_at_the_outermost_exit() -> None:
    with garbage_collected_between_iterations():
        assert gc.get_freeze_count() > 0  # the start-up heap
        with garbage_collected_between_iterations():
            assert not gc.isenabled()
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
