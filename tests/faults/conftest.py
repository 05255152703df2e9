from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.faults.support import RedisProcess, System

WORKER_ARGS = ["--max-num-seqs", "16", "--num-hbm-blocks", "4096", "--block-size", "16"]
# Capacity per worker: 16 running and 8 queued by the gateway (R7 overloads that 10x). The
# gateway's wait for a request's next output (60 s by default, sized for GPUs) is raised: on
# CI's two busy cores a request queued behind a full tiny-random batch can wait that long, and
# what these tests check (a dead worker, Redis gone) is noticed by heartbeats, not by it.
SYSTEM_ENV = {"SUPERINFER_MAX_QUEUED_REQUESTS": "8", "SUPERINFER_TOKEN_TIMEOUT_S": "300"}

MakeSystem = Callable[..., System]


@pytest.fixture
def redis_process() -> Iterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    yield server
    server.kill()


@pytest.fixture
def make_system(redis_process: RedisProcess) -> Iterator[MakeSystem]:
    """Starts Redis, control plane, worker w0 and a gateway (tiny-random), each its own
    process, with extra environment for all of them; ready when it returns."""
    systems: list[System] = []

    def make(env: dict[str, str] | None = None) -> System:
        system = System(redis_process, "tiny-random", WORKER_ARGS, {**SYSTEM_ENV, **(env or {})})
        systems.append(system)
        for name in ("control-plane", "w0", "gateway"):
            system.start(name)
        system.wait_ready()
        return system

    try:
        yield make
    finally:
        for system in systems:
            system.stop_all()


@pytest.fixture
def system(make_system: MakeSystem) -> System:
    return make_system()
