"""`PUT /admin/v1/knobs` under concurrency, on the app in process over the test Redis: 50
concurrent updates of different knobs all land (version 50 more, each knob at the value last
written to it, each response the knobs as of its own version)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from redis.asyncio import Redis

from gateway.app import create_app
from gateway.settings import GatewaySettings
from shared.knobs import knobs_from_mapping, read_knobs
from tests.redis_support import redis_url
from tests.shared.test_knobs import FIELDS, assert_serial, update

ADMIN = "test-admin-token"


@pytest.fixture
async def admin() -> AsyncIterator[httpx.AsyncClient]:
    """An admin client on the gateway app (no lifespan: the admin routes need only Redis)."""
    app = create_app(GatewaySettings(model="tiny-random", redis_url=redis_url(), admin_token=ADMIN))
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(
        transport=transport, base_url="http://gw", headers=headers, timeout=30
    ) as client:
        yield client
    await app.state.gateway.redis.aclose()


async def test_50_concurrent_admin_puts_lose_nothing(
    redis_client: Redis, admin: httpx.AsyncClient
) -> None:
    first = await admin.put("/admin/v1/knobs", json={"policy": "lvf"})
    assert first.status_code == 200, first.text
    base, base_version = await read_knobs(redis_client)
    updates = [update(i) for i in range(50)]
    responses = await asyncio.gather(*(admin.put("/admin/v1/knobs", json=u) for u in updates))
    assert [r.status_code for r in responses] == [200] * 50
    bodies = [r.json() for r in responses]
    results = [(knobs_from_mapping(b["knobs"]), b["version"]) for b in bodies]
    assert_serial(base, base_version, updates, results)
    final = (await admin.get("/admin/v1/knobs")).json()
    assert final["version"] == base_version + 50
    for name in FIELDS:  # every knob ends at the value of the last PUT that wrote it
        last = max(
            (b for u, b in zip(updates, bodies, strict=True) if name in u),
            key=lambda b: b["version"],
        )
        assert final["knobs"][name] == last["knobs"][name]
    assert final["knobs"]["policy"] == "lvf"
