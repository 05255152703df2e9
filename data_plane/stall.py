"""A hung engine step (a stuck kernel, a deadlock in a library) leaves the worker's event loop
running: its heartbeat would go on and gateways would keep routing to it. :class:`StepWatch`
tells the heartbeat when the step in progress has run far longer than any before it; the
worker then stops beating, so gateways treat it as gone (its streams end with an error, its
queued requests move) until the step ends and it beats again."""

from __future__ import annotations

import time

import structlog

log = structlog.get_logger(__name__)
STALL_FACTOR = 10.0  # a step this many times the longest one so far is stalled


class StepWatch:
    def __init__(self, min_stall_s: float) -> None:
        self.min_stall_s = min_stall_s  # never stalled sooner (the first steps, a slow host)
        self.longest_step_s = 0.0
        self._started_s: float | None = None  # monotonic start of the step in progress
        self._reported = False

    def started(self) -> None:
        self._started_s = time.monotonic()

    def ended(self, step_s: float) -> None:
        if self._reported:
            log.warning("engine_step_resumed", step_s=round(step_s, 1))
        self._started_s, self._reported = None, False
        self.longest_step_s = max(self.longest_step_s, step_s)

    @property
    def stall_s(self) -> float:
        """How long a step may run before it counts as stalled."""
        return max(self.min_stall_s, STALL_FACTOR * self.longest_step_s)

    def stalled(self) -> bool:
        """Whether the step in progress has run past :attr:`stall_s` (logged once a step)."""
        started = self._started_s
        if started is None or time.monotonic() - started <= self.stall_s:
            return False
        if not self._reported:
            self._reported = True
            log.error("engine_step_stalled", running_s=round(time.monotonic() - started, 1))
        return True
