"""A stories260K worker as a service over the test Redis (in this process), and a reader of
its outputs, for the intake and orphan tests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from data_plane.main import build_worker
from data_plane.settings import WorkerSettings
from shared import streams
from shared.protocol import SubmitRequest, TokenOutput, TokenOutputs, decode, encode
from shared.sampling import SamplingParams
from tests.redis_support import redis_url

REPLY = streams.gateway_outputs_stream("intake-test")


def settings(stories_path: Path, **overrides: Any) -> WorkerSettings:
    values: dict[str, Any] = dict(
        worker_id="w0",
        redis_url=redis_url(),
        model=str(stories_path),
        block_size=4,
        num_hbm_blocks=256,
        num_dram_blocks=0,
        max_num_batched_tokens=64,
        policy="vllm",
        idle_block_ms=20,
        heartbeat_interval_s=0.1,
    )
    values.update(overrides)
    return WorkerSettings(**values)


def submit(request_id: str, max_tokens: int = 4, reply: str = REPLY) -> SubmitRequest:
    return SubmitRequest(request_id, [1, 2, 3], reply, time.time(), SamplingParams(max_tokens, 0.0))


async def push(redis: Redis, *messages: object, worker_id: str = "w0") -> list[bytes]:
    stream = streams.worker_requests_stream(worker_id)
    return [await redis.xadd(stream, {"m": encode(m)}) for m in messages]


@contextlib.asynccontextmanager
async def running_worker(
    config: WorkerSettings, redis_class: type[Redis] = Redis
) -> AsyncIterator[RunningWorker]:
    """A :class:`RunningWorker`, stopped however the test ends."""
    running = RunningWorker(config, redis_class)
    try:
        yield running
    finally:
        await running.stop()


class RunningWorker:
    """The worker on its own client (``redis_class`` may inject faults), until :meth:`stop`."""

    def __init__(self, config: WorkerSettings, redis_class: type[Redis] = Redis) -> None:
        self.redis = redis_class.from_url(config.redis_url)
        self.worker = build_worker(config, self.redis)
        self._stop = asyncio.Event()
        self.task = asyncio.create_task(self.worker.run(self._stop))
        self.stopped = False

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self._stop.set()
        try:
            await asyncio.wait_for(self.task, 30)
        finally:
            self.worker.engine.close()
            await self.redis.aclose()


async def finished_outputs(
    redis: Redis, request_ids: set[str], timeout_s: float = 30.0, reply: str = REPLY
) -> dict[str, TokenOutput]:
    """Each request's last output (its finish), read from ``reply`` until all finished."""
    finished: dict[str, TokenOutput] = {}
    last: Any = "0-0"
    deadline = time.monotonic() + timeout_s
    while set(finished) != request_ids:
        missing = sorted(request_ids - set(finished))
        assert time.monotonic() < deadline, f"timed out waiting for {missing[:5]}"
        response = await redis.xread({reply: last}, count=512, block=100)
        for _, entries in response or []:
            for entry_id, fields in entries:
                last = entry_id
                for out in decode(fields[b"m"], TokenOutputs).outputs:
                    if out.finish_reason is not None and out.request_id in request_ids:
                        finished[out.request_id] = out
    return finished
