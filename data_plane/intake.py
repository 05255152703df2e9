"""A worker's request stream, read through its consumer group: first the entries an earlier
incarnation read but did not acknowledge (a batch per call, oldest first), then new ones. The
worker handles a batch entry by entry without any Redis call (an entry that fails is its own
problem, never the batch's), marks the handled ones :meth:`Intake.done`, and :meth:`Intake.ack`
acknowledges them (XACK) and deletes them from the stream (XDEL: an acknowledged entry is never
read again, and its prompt would otherwise stay in Redis until MAXLEN). An acknowledgement
that fails is kept and tried again at the next call; meanwhile the entry stays pending (a crash
now redelivers it, and a request the engine already owns is ignored)."""

from __future__ import annotations

from typing import Any

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from shared import streams

log = structlog.get_logger(__name__)
Entry = tuple[bytes, dict[bytes, bytes]]


class Intake:
    def __init__(self, redis: Redis, worker_id: str, read_batch: int) -> None:
        self.redis = redis
        self.worker_id = worker_id  # the consumer name: the same in every incarnation
        self.stream = streams.worker_requests_stream(worker_id)
        self.read_batch = read_batch
        self._group_ready = False  # created (or found) by the first read, inside the loop
        self._pending_after: Any = "0"  # None once the pending entries were all read
        self._handled: list[bytes] = []  # to acknowledge and delete (kept while that fails)

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) unless they exist: at the first read,
        and after Redis lost them (NOGROUP, e.g. restarted empty)."""
        try:
            await self.redis.xgroup_create(self.stream, streams.WORKER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def read(self, block_ms: int | None) -> list[Entry]:
        """The next batch: pending entries first (never blocking), then new ones. An entry
        deleted while pending (a gateway moved its request) comes with no fields."""
        if not self._group_ready:
            await self.ensure_group()
        if self._pending_after is not None:
            entries = await self._read(self._pending_after, None)
            if entries:
                self._pending_after = entries[-1][0]
                return entries
            self._pending_after = None
            log.info("pending_requests_read", worker_id=self.worker_id)
        return await self._read(">", block_ms)

    async def _read(self, after: Any, block_ms: int | None) -> list[Entry]:
        response: Any = await self.redis.xreadgroup(
            streams.WORKER_GROUP,
            self.worker_id,
            {self.stream: after},
            count=self.read_batch,
            block=block_ms,
        )
        return [
            (entry_id, fields or {})
            for _, entries in response or []
            for entry_id, fields in entries
        ]

    def done(self, entry_id: bytes) -> None:
        self._handled.append(entry_id)

    async def ack(self) -> None:
        """Acknowledge and delete every handled entry (two commands for the batch); a
        RedisError is logged and they are tried again at the next call."""
        if not self._handled:
            return
        ids, self._handled = self._handled, []
        try:
            await self.redis.xack(self.stream, streams.WORKER_GROUP, *ids)
            await self.redis.xdel(self.stream, *ids)
        except RedisError as exc:
            self._handled = ids + self._handled
            log.error(
                "request_ack_failed", worker_id=self.worker_id, num_entries=len(ids), error=str(exc)
            )
