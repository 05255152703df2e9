"""Redis is the knobs' one source, with the real worker and control plane over the test Redis:
a worker started with ``--policy lvf`` on an empty Redis seeds lvf before its first step, the
control plane plans nothing until Redis holds knobs, and every plan either makes is lvf's,
made with the version Redis holds."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from data_plane import planner as planner_module
from shared import streams
from shared.knobs import read_knobs
from shared.protocol import RotationPlan, decode
from tests.control_plane.test_services import (
    Services,
    _collect,
    _push,
    _submit,
    _until,
    _worker_settings,
)

PROMPTS = [[1, 403, 407, 261], [1, 378, 432], [1, 383, 286, 261, 376], [1, 298, 315]]


async def test_a_worker_flag_seeds_an_empty_redis_and_every_plan_is_lvfs(
    redis_client: Redis, stories_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_policies: list[str] = []
    make_plan = planner_module.make_plan

    def recording(snapshot: Any, knobs: Any) -> Any:
        local_policies.append(knobs.policy)
        return make_plan(snapshot, knobs)

    monkeypatch.setattr(planner_module, "make_plan", recording)
    assert (await read_knobs(redis_client))[1] == 0  # no knobs: an empty Redis
    services = Services(redis_client, _worker_settings(stories_path, policy="lvf"))
    planner = services.worker.planner
    try:
        await _push(redis_client, [_submit(i, p) for i, p in enumerate(PROMPTS)])
        await _until(lambda: planner.num_local + planner.num_quiet >= 5)  # planning alone first
        services.start_control_plane()
        await _collect(redis_client, {f"req-{i}" for i in range(len(PROMPTS))})
        await _push(redis_client, [_submit(i + 10, p) for i, p in enumerate(PROMPTS)])
        await _collect(redis_client, {f"req-{i + 10}" for i in range(len(PROMPTS))})
    finally:
        await services.stop()
    knobs, version = await read_knobs(redis_client)
    assert (knobs.policy, version) == ("lvf", 1)
    entries: Any = await redis_client.xrange(streams.worker_plans_stream("w0"))
    plans = [decode(fields[b"m"], RotationPlan) for _, fields in entries]
    assert plans and {(p.policy, p.knobs_version) for p in plans} == {("lvf", 1)}
    # Four short prompts never contend: each arrival is admitted at once by the local plan (a
    # remote one is stale after quiet steps, whose snapshots go only every QUIET_SNAPSHOT_S).
    assert planner.num_local > 0 and planner.num_quiet > 0
    assert local_policies and set(local_policies) == {"lvf"}
    assert planner.knobs.policy == "lvf" and planner.knobs_version == 1
