"""Virtual time for the simulator: the engine reads it, the simulated executor and transfer
engine move it forward. Nothing here sleeps."""

from __future__ import annotations


class VirtualClock:
    """A clock the engine calls like ``time.monotonic`` (``Engine(clock=VirtualClock())``)."""

    __slots__ = ("now",)

    def __init__(self, start_s: float = 0.0) -> None:
        self.now = start_s

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go back: advance({seconds})")
        self.now += seconds

    def advance_to(self, t_s: float) -> None:
        """Move to ``t_s`` if it is in the future (never backwards)."""
        if t_s > self.now:
            self.now = t_s
