"""A hung engine step (the event loop still running) stops the worker's heartbeat, so gateways
treat the worker as gone instead of routing to it for as long as the step hangs; the heartbeat
comes back when the step ends, and the request is served."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from shared import streams
from shared.protocol import WorkerStatus, decode
from tests.data_plane.worker_support import (
    finished_outputs,
    push,
    running_worker,
    settings,
    submit,
)


async def _beat_s(redis: Redis) -> float:
    raw = await redis.hget(streams.WORKERS_KEY, "w0")
    assert raw is not None
    status: Any = decode(raw, WorkerStatus)
    return float(status.t_heartbeat_s)


async def test_a_hung_step_stops_the_heartbeat_until_it_ends(
    redis_client: Redis, stories_path: Path
) -> None:
    async with running_worker(settings(stories_path, step_stall_s=0.5)) as running:
        engine = running.worker.engine
        await push(redis_client, submit("warm"))
        await finished_outputs(redis_client, {"warm"})  # steps of a few ms: stalled at 0.5 s
        released = threading.Event()
        real_step = engine.step

        def hung_step() -> Any:
            released.wait(20)
            return real_step()

        engine.step = hung_step  # type: ignore[method-assign]
        await push(redis_client, submit("hung"))
        await asyncio.sleep(1.5)
        stopped_at = await _beat_s(redis_client)
        await asyncio.sleep(0.6)
        assert await _beat_s(redis_client) == stopped_at  # no heartbeat while it hangs
        released.set()
        assert (await finished_outputs(redis_client, {"hung"}))["hung"].finish_reason
        await asyncio.sleep(0.4)
        assert await _beat_s(redis_client) > stopped_at  # beating again
