"""The worker's side of the knobs, whose one source is Redis: its flags seed them where Redis
has none (before the first step), then it follows Redis's version; new knobs reach the planner
only between steps (:meth:`WorkerKnobs.apply`), never while the engine thread plans."""

from __future__ import annotations

import structlog
from redis.asyncio import Redis

from data_plane.planner import HybridPlanner
from shared.knobs import read_knobs, seed_knobs
from shared.policy import Knobs

log = structlog.get_logger(__name__)


class WorkerKnobs:
    def __init__(self, redis: Redis, planner: HybridPlanner) -> None:
        self.redis = redis
        self.planner = planner  # holds the knobs in force and their version
        self.seeded = False
        self._new: tuple[Knobs, int] | None = None  # read, not yet applied

    async def seed(self) -> None:
        """The planner's knobs (the worker's flags) into Redis where it has none; the planner
        then holds what Redis holds (raises RedisError: retried by the caller)."""
        try:
            knobs, version = await seed_knobs(self.redis, self.planner.knobs)
        except ValueError as exc:  # written around the validating path: keep the flags
            log.error("invalid_knobs_in_redis", error=str(exc))
        else:
            self._new = (knobs, version)
            self.apply()
        self.seeded = True

    async def read(self) -> None:
        """Redis's knobs, kept for :meth:`apply` when their version changed (none there, or
        invalid ones, leave the planner with those it holds)."""
        try:
            knobs, version = await read_knobs(self.redis)
        except ValueError as exc:  # written around the validating path: keep ours
            log.error("invalid_knobs_in_redis", error=str(exc))
            return
        if version != self.planner.knobs_version and version > 0:
            self._new = (knobs, version)

    def apply(self) -> None:
        """Between steps: the planner takes the knobs read last, if any."""
        new, self._new = self._new, None
        if new is not None and new[1] != self.planner.knobs_version:
            self.planner.use_knobs(*new)
            log.info("knobs_loaded", version=new[1], policy=new[0].policy)
