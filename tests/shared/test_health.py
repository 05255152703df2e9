"""The health/metrics endpoint (shared/health.py) against a started server, through httpx."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
from redis.asyncio import Redis

from shared.health import HealthServer, probe, probe_port, redis_reachable, serve_health


class Flag:
    def __init__(self) -> None:
        self.value = False

    async def __call__(self) -> bool:
        return self.value


async def test_health_ready_and_metrics() -> None:
    registry = CollectorRegistry()
    counter = Counter("superinfer_test_events", "events", registry=registry)
    counter.inc(3)
    ready = Flag()
    async with HealthServer(ready, registry, host="127.0.0.1") as server:
        base = f"http://127.0.0.1:{server.port}"
        async with httpx.AsyncClient(base_url=base, timeout=5) as client:
            health = await client.get("/health")
            assert health.status_code == 200
            assert (await client.get("/ready")).status_code == 503
            ready.value = True
            assert (await client.get("/ready?verbose=1")).status_code == 200
            metrics = await client.get("/metrics")
            assert metrics.status_code == 200
            assert metrics.headers["content-type"].startswith("text/plain")
            assert "superinfer_test_events_total 3.0" in metrics.text
            head = await client.head("/metrics")
            assert head.status_code == 200 and head.content == b""
            assert (await client.get("/nope")).status_code == 404
            assert (await client.post("/health")).status_code == 405


async def test_readiness_check_that_raises_or_hangs_is_not_ready() -> None:
    async def broken() -> bool:
        raise RuntimeError("boom")

    async def hangs() -> bool:
        await asyncio.sleep(10)
        return True

    async with HealthServer(broken, host="127.0.0.1") as server:
        assert await server.is_ready() is False
    slow = HealthServer(hangs, host="127.0.0.1", ready_timeout_s=0.05)
    async with slow, httpx.AsyncClient(timeout=5) as client:
        response = await client.get(f"http://127.0.0.1:{slow.port}/ready")
        assert response.status_code == 503


async def test_garbage_request_gets_400_and_server_keeps_serving() -> None:
    async with HealthServer(Flag(), host="127.0.0.1") as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"hello\r\n\r\n")
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert reply.startswith(b"HTTP/1.1 400")
        async with httpx.AsyncClient(timeout=5) as client:
            response = await client.get(f"http://127.0.0.1:{server.port}/health")
            assert response.status_code == 200


async def test_close_releases_the_port() -> None:
    server = HealthServer(Flag(), host="127.0.0.1")
    await server.start()
    port = server.port
    await server.close()
    with pytest.raises(RuntimeError):
        _ = server.port
    async with HealthServer(Flag(), host="127.0.0.1", port=port) as again:
        assert again.port == port


async def test_serve_health_off_when_no_port() -> None:
    async with serve_health(None, Flag()) as server:
        assert server is None
    async with serve_health(0, Flag()) as server:
        assert server is None


async def test_probe_cli_helpers() -> None:
    assert probe_port(["9191"], {}) == 9191
    assert probe_port([], {"SUPERINFER_HEALTH_PORT": "9090", "SUPERINFER_PORT": "8000"}) == 9090
    assert probe_port([], {"SUPERINFER_HEALTH_PORT": "0", "SUPERINFER_PORT": "8001"}) == 8001
    assert probe_port([], {}) == 8000
    async with HealthServer(Flag(), host="127.0.0.1") as server:
        assert await asyncio.to_thread(probe, server.port)
        port = server.port
    assert not await asyncio.to_thread(probe, port, "/health", 0.5)


async def test_redis_reachable(redis_client: Redis) -> None:
    assert await redis_reachable(redis_client)
    dead = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    try:
        assert not await redis_reachable(dead, timeout_s=0.5)
    finally:
        await dead.aclose()
