from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.support import RedisProcess, System

WORKER_ARGS = ["--max-num-seqs", "16", "--num-hbm-blocks", "4096", "--block-size", "16"]


@pytest.fixture
def redis_process() -> Iterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    yield server
    server.kill()


@pytest.fixture
def system(redis_process: RedisProcess) -> Iterator[System]:
    """Redis, control plane, worker w0 and a gateway (tiny-random), each its own process."""
    # Capacity per worker: 16 running and 8 queued by the gateway (R7 overloads that 10x).
    env = {"SUPERINFER_MAX_QUEUED_REQUESTS": "8"}
    system = System(redis_process, "tiny-random", WORKER_ARGS, env)
    for name in ("control-plane", "w0", "gateway"):
        system.start(name)
    try:
        system.wait_ready()
        yield system
    finally:
        system.stop_all()
