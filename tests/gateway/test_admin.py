"""Admin API: auth, validation (a bad value changes nothing), changes that reach /metrics and
the control plane's next plan; per-class SLOs and API keys; request lifecycle."""

from __future__ import annotations

import time

import httpx
import pytest
from redis import Redis

from shared import streams
from shared.protocol import RotationPlan, decode
from tests.served import Served


@pytest.fixture
def admin(served: Served) -> httpx.Client:
    with httpx.Client(base_url=served.url, headers=served.admin_headers, timeout=30) as client:
        yield client
        client.put("/admin/v1/knobs", json={"policy": "vllm"})


def test_admin_needs_the_token(served: Served) -> None:
    assert httpx.get(f"{served.url}/admin/v1/knobs").status_code == 401
    wrong = {"Authorization": "Bearer not-the-token"}
    response = httpx.put(f"{served.url}/admin/v1/knobs", json={"alpha": 9}, headers=wrong)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_bad_knob_is_422_and_changes_nothing(admin: httpx.Client) -> None:
    before = admin.get("/admin/v1/knobs").json()
    for bad in ({"alpha": -1}, {"policy": "fastest"}, {"nonsense": 1}, {"slo_ttft_s": "x"}):
        response = admin.put("/admin/v1/knobs", json=bad)
        assert response.status_code == 422, bad
        assert response.json()["error"]["message"]
    assert admin.get("/admin/v1/knobs").json() == before


def test_knob_change_shows_in_metrics_and_the_next_plan(
    served: Served, admin: httpx.Client
) -> None:
    changed = admin.put("/admin/v1/knobs", json={"policy": "lvf", "alpha": 2.5}).json()
    t_put = time.monotonic()
    metrics = admin.get("/metrics").text
    assert 'superinfer:policy_info{policy="lvf"} 1.0' in metrics
    assert 'superinfer:knob{name="alpha"} 2.5' in metrics
    redis = Redis.from_url(served.redis_url)
    plans_stream = streams.worker_plans_stream("worker-0")
    plan = None
    # One request after another: each arrival is a step with something to decide (a request
    # waits), whose snapshot the control plane plans; the steps of a lone running stream have
    # nothing to decide and are planned on the worker.
    while time.monotonic() - t_put < 5.0:
        body = {"prompt": "Once", "max_tokens": 8, "ignore_eos": True}
        assert httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).is_success
        newest = redis.xrevrange(plans_stream, count=1)
        plan = decode(newest[0][1][b"m"], RotationPlan) if newest else None
        if plan is not None and plan.knobs_version == changed["version"]:
            break
    assert plan is not None and plan.knobs_version == changed["version"]
    assert plan.policy == "lvf"
    assert time.monotonic() - t_put < 5.0  # the bar is 1 s; the requests are in it
    redis.close()


def test_slo_classes_validate_and_apply(served: Served, admin: httpx.Client) -> None:
    original = admin.get("/admin/v1/slo-classes").json()["classes"]
    assert {"interactive", "standard", "batch"} <= set(original)
    bad = admin.put("/admin/v1/slo-classes", json={"gold": {"ttft_s": -1, "tbt_s": 0.1}})
    assert bad.status_code == 422
    classes = {**original, "gold": {"ttft_s": 0.5, "tbt_s": 0.04}}
    assert admin.put("/admin/v1/slo-classes", json=classes).status_code == 200
    try:
        body = {"prompt": "Once", "max_tokens": 4}
        ok = httpx.post(
            f"{served.url}/v1/completions", json=body, headers={"x-slo-class": "gold"}, timeout=30
        )
        assert ok.status_code == 200
        lifecycle = admin.get(f"/admin/v1/requests/{ok.json()['id']}").json()["lifecycle"]
        assert lifecycle["slo_class"] == "gold"
        for field in ("arrival_s", "admitted_s", "first_token_s", "finished_s"):
            assert field in lifecycle, field
        assert lifecycle["arrival_s"] <= lifecycle["admitted_s"] <= lifecycle["finished_s"]
        unknown = httpx.post(
            f"{served.url}/v1/completions", json=body, headers={"x-slo-class": "platinum"}
        )
        assert unknown.status_code == 400
        assert 'superinfer:slo_requests_total{slo_class="gold"} 1.0' in admin.get("/metrics").text
    finally:
        admin.put("/admin/v1/slo-classes", json=original)


def test_api_keys_carry_a_default_class(served: Served, admin: httpx.Client) -> None:
    created = admin.post("/admin/v1/api-keys", json={"tenant": "acme", "slo_class": "batch"})
    key = created.json()["api_key"]
    redis = Redis.from_url(served.redis_url)
    stored = redis.hkeys(streams.API_KEYS_KEY)
    assert stored and all(key.encode() not in k for k in stored)  # hashed at rest
    redis.close()
    response = httpx.post(
        f"{served.url}/v1/completions",
        json={"prompt": "Once", "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    lifecycle = admin.get(f"/admin/v1/requests/{response.json()['id']}").json()["lifecycle"]
    assert lifecycle["slo_class"] == "batch"
    assert admin.delete(f"/admin/v1/api-keys/{created.json()['key_id']}").status_code == 200
    response = httpx.post(  # the gateway's key cache forgets it at once
        f"{served.url}/v1/completions",
        json={"prompt": "Once", "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    lifecycle = admin.get(f"/admin/v1/requests/{response.json()['id']}").json()["lifecycle"]
    assert lifecycle["slo_class"] == "standard"


def test_workers_endpoint_reports_state_and_plan_source(admin: httpx.Client) -> None:
    body = admin.get("/admin/v1/workers").json()
    (worker,) = body["workers"]
    assert worker["alive"] and worker["worker_id"] == "worker-0"
    assert worker["plan_source"] in ("remote", "local")
    assert 0.0 <= worker["kv_usage_hbm"] <= 1.0
    assert body["control_plane_alive"] is True
