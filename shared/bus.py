"""Writes to the bus that more than one package makes the same way."""

from __future__ import annotations

from typing import Any

from shared import streams

# A worker announces itself (the joined stream) at its first snapshot and, while it plans
# locally (no fresh plan: no replica holds it, or a restarted one does not know it yet), again
# at most this often, so a replica takes it within one read.
ANNOUNCE_INTERVAL_S = 1.0


def should_announce(last_announced_s: float | None, planning_locally: bool, now_s: float) -> bool:
    """Whether this snapshot also announces the worker (see ANNOUNCE_INTERVAL_S)."""
    if last_announced_s is None:
        return True
    return planning_locally and now_s - last_announced_s >= ANNOUNCE_INTERVAL_S


def queue_snapshot(
    pipe: Any, worker_id: str, data: bytes, t_now_s: float, announce: bool = False
) -> None:
    """Queue on ``pipe`` (a Redis pipeline) one encoded StateSnapshot of ``worker_id``: onto
    its own stream (exactly the newest MAXLEN_WORKER_SNAPSHOTS kept) and its time into the
    registry the control plane finds workers in (the stream expires unless refreshed so);
    ``announce`` (:func:`should_announce`) also announces the worker to the replicas."""
    stream = streams.worker_snapshots_stream(worker_id)
    pipe.xadd(stream, {"m": data}, maxlen=streams.MAXLEN_WORKER_SNAPSHOTS, approximate=False)
    pipe.pexpire(stream, streams.WORKER_SNAPSHOTS_TTL_MS)  # a dead worker's goes
    pipe.zadd(streams.SNAPSHOT_WORKERS_KEY, {worker_id: t_now_s})
    if announce:
        joined = streams.WORKERS_JOINED_STREAM
        pipe.xadd(joined, {"w": worker_id}, maxlen=streams.MAXLEN_WORKERS_JOINED, approximate=True)
