"""One LVF residency controller per worker, on the worker, with the real services over the test
Redis: the value its controller holds is what local plans and the control plane's plans are
made with, what ``/admin/v1/workers`` reports either way, and a control-plane restart keeps it
(the new replica plans with the value from the next snapshot)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from control_plane import service as control_plane_service
from data_plane import planner as planner_module
from gateway.app import create_app
from gateway.settings import GatewaySettings
from shared.knobs import write_knobs
from shared.policy.adaptive import ResidencyController
from tests.control_plane.test_services import Services, _push, _submit, _until, _worker_settings
from tests.redis_support import redis_url

ADMIN = "test-admin-token"
RESIDENCY_S = 1.7  # the worker's controller's value (never the knob's 0.5)
PROMPTS = [[1, 403, 407, 261], [1, 378, 432], [1, 383, 286, 261, 376], [1, 298, 315]]


@pytest.fixture
async def admin() -> AsyncIterator[Any]:
    """``admin()``: the worker row of ``/admin/v1/workers`` on a gateway app in process (its
    directory refreshed from Redis first, as its refresh loop does)."""
    app = create_app(GatewaySettings(model="tiny-random", redis_url=redis_url(), admin_token=ADMIN))
    state = app.state.gateway
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as c:

        async def row() -> dict[str, Any] | None:
            await state.directory.refresh()
            workers = (await c.get("/admin/v1/workers")).json()["workers"]
            return dict(workers[0]) if workers else None  # none before its first heartbeat

        yield row
    await state.redis.aclose()


def _record(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[float]]:
    """The residency every local and every control-plane plan is made with."""
    seen: dict[str, list[float]] = {"local": [], "remote": []}
    make_plan, plan_handles = planner_module.make_plan, control_plane_service.plan_handles

    def local(snapshot: Any, knobs: Any) -> Any:
        seen["local"].append(knobs.min_residency_s)
        return make_plan(snapshot, knobs)

    def remote(snapshot: Any, knobs: Any) -> Any:
        seen["remote"].append(knobs.min_residency_s)
        return plan_handles(snapshot, knobs)

    monkeypatch.setattr(planner_module, "make_plan", local)
    monkeypatch.setattr(control_plane_service, "plan_handles", remote)
    return seen


async def _reported(admin: Any, source: str) -> dict[str, Any]:
    """The worker's row once it reports planning from ``source``."""
    for _ in range(500):
        row = await admin()
        if row is not None and row["plan_source"] == source:
            return row
        await asyncio.sleep(0.01)
    raise AssertionError(f"the worker never reported plan_source {source}")


async def test_the_residency_in_force_is_reported_and_survives_a_restart(
    redis_client: Redis, stories_path: Any, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    await write_knobs(redis_client, {"policy": "lvf", "slo_ttft_s": 0.05, "slo_tbt_s": 0.01})
    seen = _record(monkeypatch)
    # 20 blocks: the four requests contend, so steps have something to decide and every phase
    # plans (a step with nothing to decide plans locally and sends no snapshot to plan).
    settings = _worker_settings(stories_path, heartbeat_interval_s=0.05, num_hbm_blocks=20)
    services = Services(redis_client, settings)
    planner = services.worker.planner
    try:
        await _until(lambda: planner.knobs_version > 0)  # Redis's knobs, before any step
        planner.residency = ResidencyController(value_s=RESIDENCY_S, period_s=1e9)  # held there
        seen["local"].clear()  # the warm-up's steps, at build
        for phase in range(3):  # local; remote; remote from a restarted control plane
            if phase == 2:
                await services.kill_control_plane()
                seen["remote"].clear()
            if phase > 0:  # the replica holds w0 before the requests come, so it plans for them
                services.start_control_plane()
                await _until(lambda: services.cp is not None and "w0" in services.cp.leases.owned)
            await _push(redis_client, [_submit(10 * phase + i, p) for i, p in enumerate(PROMPTS)])
            source = "remote" if phase else "local"
            await _until(lambda: len(seen[source]) >= 5)  # noqa: B023 (awaited in the loop)
            row = await _reported(admin, "local" if phase == 0 else "remote")
            assert row["lvf_min_residency_s"] == RESIDENCY_S, phase
    finally:
        await services.stop()
    assert set(seen["local"]) == {RESIDENCY_S}
    assert set(seen["remote"]) == {RESIDENCY_S}  # the restarted replica's plans too
