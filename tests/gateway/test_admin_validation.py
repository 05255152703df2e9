"""The admin API against wrong-typed and absurd bodies, on the gateway app in process over the
test Redis: each is a 422 (a body that is not JSON at all a 400) and changes nothing, never a
500; absurd knobs are 422; removing an SLO class that keys use is a 409 naming them unless
forced (then the reply says where they are served), also when a key or class changes between
the check and the write; a key is deleted by its whole id only."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from gateway import admin as admin_module
from gateway import auth
from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.tenancy import Caller, served_class
from shared import streams
from shared.slo import SloClass, read_slo_classes, write_slo_classes
from tests.redis_support import redis_url

ADMIN = "test-admin-token"
GOLD = {"ttft_s": 0.5, "tbt_s": 0.04}
DEFAULTS = {
    "interactive": {"ttft_s": 1.0, "tbt_s": 0.05},
    "standard": {"ttft_s": 5.0, "tbt_s": 0.1},
    "batch": {"ttft_s": 60.0, "tbt_s": 1.0},
}


def admin_client(**settings: Any) -> tuple[Any, httpx.AsyncClient]:
    """The gateway app (no lifespan: the admin routes need only Redis) and an admin client."""
    app = create_app(
        GatewaySettings(model="tiny-random", redis_url=redis_url(), admin_token=ADMIN, **settings)
    )
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://gw",
        headers={"Authorization": f"Bearer {ADMIN}", "content-type": "application/json"},
        timeout=30,
    )
    return app, client


@pytest.fixture
async def admin(redis_client: Redis) -> AsyncIterator[httpx.AsyncClient]:
    app, client = admin_client()
    async with client:
        yield client
    await app.state.gateway.redis.aclose()


# The and the fuzz's values, as JSON text (NaN, 1e999 and a lone surrogate are not
# expressible through json=).
HOSTILE = [
    "[]",
    '["batch"]',
    '{"x": 1}',
    "true",
    "1e23",
    "1e300",
    "1e308",
    "1e999",
    "-1e999",
    "NaN",
    "Infinity",
    "9" * 5000,
    '"a\\ud800b"',
    '"\\udfff"',
    '"' + "x" * 100_000 + '"',
    "[" * 10_000 + "]" * 10_000,
    '{"a":' * 10_000 + "1" + "}" * 10_000,
]
BODIES: dict[tuple[str, str], dict[str, str]] = {  # a valid body of each, as JSON texts
    ("PUT", "/admin/v1/knobs"): {"alpha": "2.0", "b_xfer": "64", "policy": '"lvf"'},
    ("PUT", "/admin/v1/slo-classes"): {"gold": '{"ttft_s": 0.5, "tbt_s": 0.04}'},
    ("POST", "/admin/v1/api-keys"): {"tenant": '"acme"', "slo_class": '"batch"'},
}
NESTED_FIELDS = {("PUT", "/admin/v1/slo-classes"): ("ttft_s", "tbt_s")}


def _object(fields: dict[str, str]) -> str:
    return "{" + ", ".join(f'"{name}": {value}' for name, value in fields.items()) + "}"


def hostile_cases() -> list[tuple[str, str, str]]:
    """(method, path, body): each hostile value as the whole body and as each field's value
    (in an otherwise valid body), and each field of an SLO class."""
    cases = [(method, path, "null") for method, path in BODIES]  # null is a valid field value
    for (method, path), fields in BODIES.items():
        for value in HOSTILE:
            cases.append((method, path, value))
            for name in fields:
                cases.append((method, path, _object({**fields, name: value})))
        for name, value in itertools.product(NESTED_FIELDS.get((method, path), ()), HOSTILE):
            cls = {"ttft_s": "0.5", "tbt_s": "0.04", name: value}
            cases.append((method, path, _object({"gold": _object(cls)})))
    return cases


async def _state_of(admin: httpx.AsyncClient) -> tuple[Any, ...]:
    knobs = (await admin.get("/admin/v1/knobs")).json()
    classes = (await admin.get("/admin/v1/slo-classes")).json()
    return knobs, classes


async def test_every_hostile_body_is_4xx_and_changes_nothing(
    admin: httpx.AsyncClient, redis_client: Redis
) -> None:
    before = await _state_of(admin)
    cases = hostile_cases()
    statuses = []
    for method, path, body in cases:
        response = await admin.request(method, path, content=body.encode("utf-8", "surrogatepass"))
        assert 400 <= response.status_code < 500, (method, path, body[:80], response.text[:300])
        error = response.json()["error"]
        assert error["message"] and "Traceback" not in error["message"]
        statuses.append(response.status_code)
    assert await _state_of(admin) == before
    assert await redis_client.hlen("superinfer:api_keys") == 0
    print(f"{len(cases)} hostile admin bodies: {sorted(set(statuses))}, no 5xx")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/admin/v1/api-keys", {"tenant": "acme", "slo_class": ["batch"]}),
        ("/admin/v1/api-keys", {"tenant": "acme", "slo_class": {"name": "batch"}}),
        ("/admin/v1/api-keys", {"tenant": ["acme"]}),
        ("/admin/v1/api-keys", {"tenant": "acme", "min_priority": True}),
        ("/admin/v1/api-keys", {"tenant": "acme", "min_priority": 1.5}),
        ("/admin/v1/api-keys", ["acme"]),
        ("/admin/v1/knobs", ["alpha", 2]),
        ("/admin/v1/knobs", {"alpha": True}),
        ("/admin/v1/knobs", {"b_xfer": 1e23}),
        ("/admin/v1/knobs", {"alpha": 1e300}),
        ("/admin/v1/knobs", {"min_residency_s": 1e308}),
        ("/admin/v1/knobs", {"b_xfer": 2.5}),
        ("/admin/v1/slo-classes", {"gold": [0.5, 0.04]}),
        ("/admin/v1/slo-classes", {"gold": {"ttft_s": True, "tbt_s": 0.04}}),
        ("/admin/v1/slo-classes", {"gold": {"ttft_s": 1e308, "tbt_s": 0.04}}),
        ("/admin/v1/slo-classes", "gold"),
    ],
)
async def test_wrong_types_and_absurd_values_are_422(
    admin: httpx.AsyncClient, path: str, body: Any
) -> None:
    method = "POST" if path.endswith("api-keys") else "PUT"
    response = await admin.request(method, path, json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_a_lone_surrogate_tenant_is_422(admin: httpx.AsyncClient) -> None:
    body = b'{"tenant": "acme\\ud800"}'
    response = await admin.post("/admin/v1/api-keys", content=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == "tenant"


async def test_removing_a_class_that_keys_use_is_409_unless_forced(
    admin: httpx.AsyncClient,
) -> None:
    assert (await admin.put("/admin/v1/slo-classes", json={**DEFAULTS, "gold": GOLD})).is_success
    app_state = admin._transport.app.state.gateway  # type: ignore[attr-defined]
    created = await admin.post("/admin/v1/api-keys", json={"tenant": "t", "slo_class": "gold"})
    key_id = created.json()["key_id"]
    refused = await admin.put("/admin/v1/slo-classes", json=DEFAULTS)
    assert refused.status_code == 409, refused.text
    assert key_id in refused.json()["error"]["message"]
    assert "gold" in (await admin.get("/admin/v1/slo-classes")).json()["classes"]
    forced = await admin.put("/admin/v1/slo-classes", params={"force": "true"}, json=DEFAULTS)
    assert forced.status_code == 200, forced.text
    assert forced.json()["forced"] == {"keys": {"gold": [key_id]}, "served_in": "standard"}
    key = await app_state.api_keys.lookup(created.json()["api_key"])
    assert served_class(app_state, Caller(key), None).name == "standard"


async def test_removing_the_default_class_that_classless_keys_use_is_409(
    admin: httpx.AsyncClient,
) -> None:
    created = await admin.post("/admin/v1/api-keys", json={"tenant": "t"})
    without_default = {"gold": GOLD, "batch": DEFAULTS["batch"]}
    refused = await admin.put("/admin/v1/slo-classes", json=without_default)
    assert refused.status_code == 409, refused.text
    assert created.json()["key_id"] in refused.json()["error"]["message"]


async def test_a_key_made_while_classes_are_replaced_is_seen(
    admin: httpx.AsyncClient, redis_client: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key naming a class is created (another gateway, a real Redis write) after the check
    read the keys and before the classes are written: the write retries and refuses."""
    assert (await admin.put("/admin/v1/slo-classes", json={**DEFAULTS, "gold": GOLD})).is_success
    made: list[str] = []

    async def keys_then_a_new_one(redis: Redis) -> dict[str | None, list[str]]:
        found = await auth.keys_by_class(redis)
        if not made:
            made.append((await auth.create_api_key(redis_client, "late", "gold"))[1].key_id)
        return found

    monkeypatch.setattr(admin_module, "keys_by_class", keys_then_a_new_one)
    refused = await admin.put("/admin/v1/slo-classes", json=DEFAULTS)
    assert refused.status_code == 409, refused.text
    assert made[0] in refused.json()["error"]["message"]
    assert "gold" in (await admin.get("/admin/v1/slo-classes")).json()["classes"]


async def test_a_key_for_a_class_removed_meanwhile_is_refused(
    admin: httpx.AsyncClient, redis_client: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The class a key names is removed after the key's check read it: the key is not kept."""
    assert (await admin.put("/admin/v1/slo-classes", json={**DEFAULTS, "gold": GOLD})).is_success
    removed: list[bool] = []

    async def classes_then_removed(redis: Redis) -> tuple[dict[str, SloClass], int]:
        found = await read_slo_classes(redis)
        if not removed:
            removed.append(True)
            await write_slo_classes(redis_client, DEFAULTS)
        return found

    monkeypatch.setattr(auth, "read_slo_classes", classes_then_removed)
    refused = await admin.post("/admin/v1/api-keys", json={"tenant": "t", "slo_class": "gold"})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["param"] == "slo_class"
    assert not await auth.keys_by_class(redis_client)


async def test_a_key_may_name_a_class_another_gateway_just_added(
    admin: httpx.AsyncClient, redis_client: Redis
) -> None:
    """The class check reads Redis, not this gateway's cached classes."""
    await admin.get("/admin/v1/slo-classes")
    await write_slo_classes(redis_client, {**DEFAULTS, "gold": GOLD})
    created = await admin.post("/admin/v1/api-keys", json={"tenant": "t", "slo_class": "gold"})
    assert created.status_code == 200, created.text


async def test_a_key_is_deleted_by_its_whole_id_only(admin: httpx.AsyncClient) -> None:
    created = (await admin.post("/admin/v1/api-keys", json={"tenant": "t"})).json()
    key_id = created["key_id"]
    for partial in (key_id[:8], key_id[:15], key_id.upper(), key_id + "0", "0" * 16):
        response = await admin.delete(f"/admin/v1/api-keys/{partial}")
        assert response.status_code in (404, 422), (partial, response.text)
    app_state = admin._transport.app.state.gateway  # type: ignore[attr-defined]
    assert await app_state.api_keys.lookup(created["api_key"]) is not None  # still there
    assert (await admin.delete(f"/admin/v1/api-keys/{key_id}")).status_code == 200
    assert (await admin.delete(f"/admin/v1/api-keys/{key_id}")).status_code == 404


async def test_knob_refusals_name_the_knob_and_take_auto_in_any_case(
    admin: httpx.AsyncClient,
) -> None:
    """A knob's 422 had param "knobs" whatever the knob; "AUTO" was a 422 where the services'
    settings take it; an empty PUT made a new version."""
    refused = await admin.put("/admin/v1/knobs", json={"alpha": -1})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "alpha"
    unknown = await admin.put("/admin/v1/knobs", json={"alpah": 1})
    assert unknown.json()["error"]["param"] == "alpah"
    taken = await admin.put("/admin/v1/knobs", json={"b_xfer": "AUTO", "demote_late_s": "Off"})
    assert taken.status_code == 200, taken.text
    knobs = taken.json()
    assert knobs["knobs"]["b_xfer"] == "auto" and knobs["knobs"]["demote_late_s"] == "off"
    same = await admin.put("/admin/v1/knobs", json={})
    assert same.status_code == 200 and same.json()["version"] == knobs["version"]
    reserved = await admin.put("/admin/v1/slo-classes", json={"version": {"ttft_s": 1, "tbt_s": 1}})
    assert reserved.status_code == 422 and "reserved" in reserved.json()["error"]["message"]


async def test_a_stored_knob_that_does_not_validate_is_named_and_repaired(
    admin: httpx.AsyncClient, redis_client: Redis
) -> None:
    """A value written by hand past validation made GET a bare 500; now a 409 naming it, and
    a PUT of that knob repairs it."""
    await redis_client.hset(streams.KNOBS_KEY, mapping={"alpha": "garbage", "version": 7})
    broken = await admin.get("/admin/v1/knobs")
    assert broken.status_code == 409, broken.text
    assert broken.json()["error"]["param"] == "alpha"
    repaired = await admin.put("/admin/v1/knobs", json={"alpha": 2.0})
    assert repaired.status_code == 200, repaired.text
    got = await admin.get("/admin/v1/knobs")
    assert got.status_code == 200 and got.json()["knobs"]["alpha"] == 2.0


async def test_cors_is_vllms_by_default_and_follows_the_settings(redis_client: Redis) -> None:
    """Browsers on another origin may call the API (vLLM's default: any origin); an operator's
    list admits only its origins."""
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    for origins, allowed in ((None, True), (["https://other.example"], False)):
        settings = {} if origins is None else {"allowed_origins": origins}
        app, client = admin_client(**settings)
        async with client:
            answer = await client.options("/v1/chat/completions", headers=preflight)
            assert answer.is_success == allowed, answer.text
            got = await client.get("/admin/v1/knobs", headers={"Origin": "https://app.example"})
            assert ("access-control-allow-origin" in got.headers) == allowed
        await app.state.gateway.redis.aclose()
