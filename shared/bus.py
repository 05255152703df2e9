"""Writes to the bus that more than one package makes the same way."""

from __future__ import annotations

from typing import Any

from shared import streams


def queue_snapshot(
    pipe: Any, worker_id: str, data: bytes, t_now_s: float, first: bool = False
) -> None:
    """Queue on ``pipe`` (a Redis pipeline) one encoded StateSnapshot of ``worker_id``: onto
    its own stream (exactly the newest MAXLEN_WORKER_SNAPSHOTS kept) and its time into the
    registry the control plane finds workers in (the stream expires unless refreshed so);
    ``first`` (the incarnation's first) also
    announces the worker to the replicas."""
    stream = streams.worker_snapshots_stream(worker_id)
    pipe.xadd(stream, {"m": data}, maxlen=streams.MAXLEN_WORKER_SNAPSHOTS, approximate=False)
    pipe.pexpire(stream, streams.WORKER_SNAPSHOTS_TTL_MS)  # a dead worker's goes
    pipe.zadd(streams.SNAPSHOT_WORKERS_KEY, {worker_id: t_now_s})
    if first:
        joined = streams.WORKERS_JOINED_STREAM
        pipe.xadd(joined, {"w": worker_id}, maxlen=streams.MAXLEN_WORKERS_JOINED, approximate=True)
