"""The worker's loop: with requests in flight the engine step runs in its thread while the next
requests and plans are read, and what was read reaches the engine and the planner only after
the step (they change between steps only); a failed read loses nothing the other read got."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any, cast

import pytest
from redis.exceptions import ConnectionError

from data_plane.admission import Admission
from data_plane.grammar_intake import PendingGrammars
from data_plane.orphans import GatewayWatch
from data_plane.service import Worker


class Recorder:
    """Fakes of what one ``Worker._iterate`` touches, recording the order of events."""

    def __init__(self, fetch_error: Exception | None = None) -> None:
        self.events: list[str] = []
        self.in_step = threading.Event()
        self.release_step = threading.Event()
        self.fetch_error = fetch_error

    def step_in_thread(self) -> None:
        self.in_step.set()
        self.events.append("step started")
        if not self.release_step.wait(timeout=10):
            raise TimeoutError("the step was never released")
        self.events.append("step done")

    async def step(self) -> None:
        await asyncio.to_thread(self.step_in_thread)

    async def fetch(self, block_ms: int | None) -> tuple[Any, Any]:
        await asyncio.to_thread(self.in_step.wait, 10)
        self.events.append(f"fetched while stepping={self.in_step.is_set()} block={block_ms}")
        self.release_step.set()
        return [(b"1-0", {b"m": b"x"})], self.fetch_error or ["plan"]

    def take(self, entries: list[Any]) -> None:
        self.events.append(f"took {len(entries)} entries")

    def offer(self, plans: list[Any]) -> None:
        self.events.append(f"offered {plans}")

    async def ack(self) -> None:
        self.events.append("acked")


async def _nothing_in_flight() -> None:
    pass


def _worker(recorder: Recorder) -> Worker:
    worker = Worker.__new__(Worker)
    worker.engine = cast(Any, SimpleNamespace(has_unfinished=lambda: True))
    worker.knobs = cast(Any, SimpleNamespace(seeded=True, apply=lambda: None))
    worker.gateways = GatewayWatch(dead_s=10.0, forget_s=3600.0)
    worker.grammars = PendingGrammars(lambda structured: None, lambda structured: True)
    worker.admission = Admission(
        worker.engine, cast(Any, None), worker.gateways, worker.grammars, "w0"
    )
    worker.intake = cast(Any, SimpleNamespace(ack=recorder.ack))
    worker._refresh_status = lambda: None  # type: ignore[method-assign]
    worker._step = recorder.step  # type: ignore[method-assign]
    worker._fetch = recorder.fetch  # type: ignore[method-assign]
    worker._take_requests = recorder.take  # type: ignore[method-assign]
    worker._offer_plans = recorder.offer  # type: ignore[method-assign]
    return worker


async def test_requests_and_plans_are_read_during_the_step_and_applied_after_it() -> None:
    recorder = Recorder()
    await _worker(recorder)._iterate()
    assert recorder.events == [
        "step started",
        "fetched while stepping=True block=None",  # busy: the read never blocks
        "step done",
        "offered ['plan']",
        "took 1 entries",
        "acked",
    ]


async def test_a_failed_plan_read_still_takes_the_requests_then_raises() -> None:
    recorder = Recorder(fetch_error=ConnectionError("plans away"))
    with pytest.raises(ConnectionError, match="plans away"):
        await _worker(recorder)._iterate()
    assert recorder.events[-2:] == ["took 1 entries", "acked"]  # nothing read was lost


async def test_an_idle_worker_whose_retried_write_fails_still_takes_what_it_read() -> None:
    """Idle, it sends what a failed write left; that write failing again left the requests it
    had just read unapplied (unacknowledged, never redelivered to it)."""
    recorder = Recorder()
    recorder.in_step.set()  # no step: the read returns at once
    worker = _worker(recorder)
    worker.engine = cast(Any, SimpleNamespace(has_unfinished=lambda: False))
    worker.settings = cast(Any, SimpleNamespace(idle_block_ms=5))

    async def send_fails(redis: Any, outputs: Any) -> None:
        raise ConnectionError("still away")

    worker.replies = cast(Any, SimpleNamespace(has_pending=True, send=send_fails))
    worker.outbox = cast(Any, SimpleNamespace(flush=_nothing_in_flight))
    worker.redis = cast(Any, None)
    with pytest.raises(ConnectionError, match="still away"):
        await worker._iterate()
    assert recorder.events[-2:] == ["took 1 entries", "acked"]
