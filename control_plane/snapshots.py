"""Which workers exist, and the newest snapshot of each one this replica owns.

Workers are found in a registry (``streams.SNAPSHOT_WORKERS_KEY``: worker id -> the time of
its newest snapshot or heartbeat, written by the worker with each: an idle worker stays
listed); one whose time stops changing
for ``forget_s`` (this replica's clock: the workers' clocks are never compared with it) is
gone. Each worker publishes on its own stream, so a replica reads only the workers whose lease
it holds and Redis ships every snapshot once, whatever the number of replicas. Only the newest
entry per worker matters; older ones are skipped. A snapshot sent as a delta is rebuilt against
the table it names (:class:`shared.protocol.delta.DeltaDecoder`, one per worker).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import structlog
from redis.asyncio import Redis

from shared import streams
from shared.policy import RequestColumns
from shared.protocol import ProtocolError, StateSnapshot, decode
from shared.protocol.delta import DeltaDecoder, MissingBase

log = structlog.get_logger(__name__)
# A registry entry whose score stood still this long, as this replica watched, is deleted
REGISTRY_KEEP_S = 3600.0
# A replica starting reads the announcements of the last 2 s (a worker unplanned for longer
# announces again every shared.bus.ANNOUNCE_INTERVAL_S).
JOINED_LOOKBACK_MS = 2000


class WorkerDirectory:
    """The workers alive recently, from the registry: one whose score changed within
    ``forget_s`` (as this replica watched it), or that announced itself since. An entry seen
    for the first time counts only once its score changes (a dead worker's entry never does)."""

    def __init__(self, forget_s: float) -> None:
        self.forget_s = forget_s
        # id -> (its score, when this replica saw it change; -inf: never)
        self._seen: dict[str, tuple[float, float]] = {}
        self._still_since: dict[str, float] = {}  # id -> when its score last changed or appeared

    @property
    def workers(self) -> set[str]:
        now = time.monotonic()
        return {w for w, (_, changed_s) in self._seen.items() if now - changed_s < self.forget_s}

    def joined(self, worker_ids: list[str]) -> None:
        """Workers that announced a new incarnation: alive from now."""
        now = time.monotonic()
        for worker_id in worker_ids:
            score = self._seen.get(worker_id, (math.nan, 0.0))[0]
            self._seen[worker_id] = (score, now)

    async def refresh(self, redis: Redis) -> set[str]:
        """Read the registry; return the workers whose snapshots still come."""
        entries: Any = await redis.zrange(streams.SNAPSHOT_WORKERS_KEY, 0, -1, withscores=True)
        now = time.monotonic()
        seen: dict[str, tuple[float, float]] = {}
        for member, score in entries:
            worker_id = member.decode() if isinstance(member, bytes) else str(member)
            last = self._seen.get(worker_id)
            if last is None:
                seen[worker_id] = (score, -math.inf)
            else:
                seen[worker_id] = (score, now if last[0] != score else last[1])
        still = {w: self._still_since.get(w, now) for w in seen}
        for worker_id, (_, changed_s) in seen.items():
            if changed_s == now:
                still[worker_id] = now
        gone = [w for w, since in still.items() if now - since > REGISTRY_KEEP_S]
        if gone:  # long-gone workers: judged by change, never by comparing workers' clocks
            await redis.zrem(streams.SNAPSHOT_WORKERS_KEY, *gone)
        self._seen, self._still_since = seen, still
        return self.workers


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """A decoded snapshot and its whole table as policy columns."""

    msg: StateSnapshot
    columns: RequestColumns


class SnapshotReader:
    """Blocking reads of the owned workers' snapshot streams, newest entry per worker, and of
    the stream announcing new workers."""

    def __init__(self, redis: Redis, read_block_ms: int) -> None:
        self.redis = redis
        self.read_block_ms = read_block_ms
        self._last_ids: dict[str, Any] = {}
        self._last_joined_id: Any = None  # set at the first read (JOINED_LOOKBACK_MS back)
        self._decoders: dict[str, DeltaDecoder] = {}
        self.num_malformed = 0
        self.num_missing_base = 0  # deltas against a table this replica does not hold
        self.num_deltas = 0  # snapshots rebuilt from a delta
        self.num_bytes = 0

    def keep_only(self, owned: set[str]) -> None:
        """Forget the read positions and tables of workers no longer owned (one acquired
        again starts from its stream's oldest kept entry)."""
        for table in (self._last_ids, self._decoders):
            for worker_id in set(table) - owned:
                del table[worker_id]

    async def read(self, owned: set[str]) -> tuple[list[WorkerSnapshot], list[str]]:
        """(the newest new snapshot of each owned worker that has one, the workers that
        announced themselves), blocking up to the read block time for either; malformed or
        unrebuildable snapshots are counted and skipped."""
        cursors: dict[Any, Any] = {
            streams.worker_snapshots_stream(w): self._last_ids.get(w, "0-0") for w in sorted(owned)
        }
        if self._last_joined_id is None:  # stream ids are Redis's clock in ms
            seconds, micros = await self.redis.time()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            self._last_joined_id = f"{max(0, now_ms - JOINED_LOOKBACK_MS)}-0"
        cursors[streams.WORKERS_JOINED_STREAM] = self._last_joined_id
        response: Any = await self.redis.xread(
            cursors, count=streams.MAXLEN_WORKER_SNAPSHOTS, block=self.read_block_ms
        )
        snapshots: list[WorkerSnapshot] = []
        joined: list[str] = []
        for stream, entries in response or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            if name == streams.WORKERS_JOINED_STREAM:
                self._last_joined_id = entries[-1][0]
                joined += self._joined_ids(entries)
                continue
            worker_id = streams.worker_of_snapshots_stream(name)
            if worker_id is None or worker_id not in owned or not entries:
                continue
            self._last_ids[worker_id] = entries[-1][0]
            data = entries[-1][1].get(b"m", b"")
            self.num_bytes += len(data)
            snapshot = self._decoded(worker_id, data)
            if snapshot is not None:
                snapshots.append(snapshot)
        return snapshots, joined

    def _joined_ids(self, entries: list[Any]) -> list[str]:
        """The worker ids the announcements name; a malformed one is counted and skipped."""
        ids = []
        for _, fields in entries:
            raw = fields.get(b"w")
            try:
                if not isinstance(raw, bytes):
                    raise ValueError(f"no worker id in {sorted(fields)[:4]!r}")
                ids.append(raw.decode())
            except ValueError as exc:  # UnicodeDecodeError is one
                self.num_malformed += 1
                log.error("malformed_announcement", error=str(exc)[:200])
        return ids

    def _decoded(self, worker_id: str, data: bytes) -> WorkerSnapshot | None:
        decoder = self._decoders.setdefault(worker_id, DeltaDecoder())
        try:
            msg = decode(data, StateSnapshot)
            if msg.worker_id != worker_id:
                raise ProtocolError(f"snapshot of {msg.worker_id!r} on {worker_id!r}'s stream")
            snapshot = WorkerSnapshot(msg, decoder.columns(msg))
            self.num_deltas += msg.delta is not None
            return snapshot
        except MissingBase as exc:  # a handover or a restart: the worker sends a whole one soon
            self.num_missing_base += 1
            log.info("snapshot_base_missing", worker_id=worker_id, error=str(exc))
        except ValueError as exc:  # ProtocolError, or a rebuilt table that does not fit
            self.num_malformed += 1
            log.error("malformed_snapshot", worker_id=worker_id, error=str(exc))
        return None
