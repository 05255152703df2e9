"""A key's SLO class is a ceiling and its ``min_priority`` a floor: a batch-class key asking for
interactive (or for a better priority) is served as batch (at its floor); asking for less is
honoured. Without a key (open mode) the header and ``priority`` are taken as sent."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from gateway.auth import ApiKey
from gateway.errors import APIError
from gateway.tenancy import Caller, served_class, served_priority
from shared.slo import DEFAULT_SLO_CLASSES, SloClass
from tests.served import Served


def _state(default: str = "standard", **extra: SloClass) -> Any:
    classes = {**DEFAULT_SLO_CLASSES, **extra}
    directory = SimpleNamespace(slo_classes=classes)
    return SimpleNamespace(directory=directory, settings=SimpleNamespace(default_slo_class=default))


def _caller(slo_class: str | None, min_priority: int = 0) -> Caller:
    return Caller(ApiKey("0123456789abcdef", "acme", slo_class, min_priority))


def test_the_key_class_is_a_ceiling() -> None:
    # Looser TTFT but a tighter TBT than standard: not "no tighter", so not above the ceiling.
    state = _state(streaming=SloClass("streaming", 10.0, 0.02))
    served = {
        (key, header): served_class(state, _caller(key), header).name
        for key in ("interactive", "standard", "batch", None)
        for header in ("interactive", "standard", "batch", "streaming", None)
    }
    assert served[("batch", "interactive")] == "batch"
    assert served[("batch", "standard")] == "batch"
    assert served[("standard", "interactive")] == "standard"
    assert served[("standard", "streaming")] == "standard"
    assert served[(None, "interactive")] == "standard"  # no class on the key: the default's
    assert served[("interactive", "batch")] == "batch"  # asking for less is fine
    assert served[("interactive", "streaming")] == "interactive"  # TBT tighter than the key's
    assert served[("standard", None)] == "standard" and served[("batch", None)] == "batch"
    anonymous = Caller(None)
    assert served_class(state, anonymous, "interactive").name == "interactive"  # open mode
    assert served_class(state, anonymous, None).name == "standard"


def test_an_unknown_class_is_not_echoed_whole() -> None:
    with pytest.raises(APIError) as refused:
        served_class(_state(), Caller(None), "x" * 30_000)
    assert refused.value.param == "x-slo-class" and len(refused.value.message) < 300


def test_a_default_class_that_is_not_one_serves_in_the_loosest() -> None:
    """A mistyped ``default_slo_class`` served every unclassed request in the first class of
    the hash (interactive, the tightest), ahead of those that chose one."""
    state = _state(default="nosuch")
    assert served_class(state, Caller(None), None).name == "batch"
    assert served_class(state, _caller(None), None).name == "batch"
    assert served_class(state, _caller(None), "interactive").name == "batch"  # the ceiling


def test_priority_is_clamped_to_the_key_floor() -> None:
    assert served_priority(_caller("batch"), -100, "lvf") == 0
    assert served_priority(_caller("batch"), 7, "lvf") == 7
    assert served_priority(_caller("batch", min_priority=-5), -100, "vllm-priority") == -5
    assert served_priority(Caller(None), -100, "lvf") == -100  # open mode


@pytest.mark.parametrize("policy", ["vllm", "swap", "edf"])
def test_a_priority_the_policy_does_not_order_by_is_refused(policy: str) -> None:
    """Accepted and ignored before (only vllm-priority read it); lvf orders by it now."""
    with pytest.raises(APIError, match=f"the {policy} policy in force") as refused:
        served_priority(Caller(None), -3, policy)
    assert refused.value.param == "priority"
    assert served_priority(Caller(None), 0, policy) == 0  # the default is no request at all


@pytest.fixture
def admin(served: Served) -> Iterator[httpx.Client]:
    """The admin API, with a policy that orders by ``priority`` (another test may have left
    one that refuses it) put back as it was afterwards."""
    with httpx.Client(base_url=served.url, headers=served.admin_headers, timeout=30) as client:
        before = client.get("/admin/v1/knobs").json()["knobs"]["policy"]
        assert client.put("/admin/v1/knobs", json={"policy": "lvf"}).status_code == 200
        yield client
        client.put("/admin/v1/knobs", json={"policy": before})


def _lifecycle(served: Served, admin: httpx.Client, body: dict[str, Any], headers: Any) -> Any:
    """The lifecycle record of a completion of ``body``, once the gateway wrote its part."""
    response = httpx.post(f"{served.url}/v1/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 10
    while True:  # the gateway writes its part of the record as the request finishes
        record = admin.get(f"/admin/v1/requests/{response.json()['id']}").json()
        lifecycle = record.get("lifecycle", {})
        if ("priority" in lifecycle and "slo_class" in lifecycle) or time.monotonic() > deadline:
            return lifecycle
        time.sleep(0.05)


def _served_as(
    served: Served, admin: httpx.Client, key: str | None, slo: str | None, priority: int
) -> tuple[str, float]:
    """(class, priority) a request was served with, from its lifecycle record."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if slo is not None:
        headers["x-slo-class"] = slo
    body = {"prompt": "Once", "max_tokens": 2, "priority": priority}
    lifecycle = _lifecycle(served, admin, body, headers)
    return lifecycle.get("slo_class", ""), lifecycle.get("priority", float("nan"))


def test_openai_user_is_kept_in_the_lifecycle_record(served: Served, admin: httpx.Client) -> None:
    """OpenAI's ``user`` (an end-user id for abuse monitoring) was accepted and dropped."""
    body = {"prompt": "Once", "max_tokens": 2, "user": "end-user-42"}
    assert _lifecycle(served, admin, body, {}).get("user") == "end-user-42"
    too_long = httpx.post(
        f"{served.url}/v1/completions", json={**body, "user": "u" * 513}, timeout=30
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "user"


def test_a_batch_key_asking_for_interactive_is_served_as_batch(
    served: Served, admin: httpx.Client
) -> None:
    keys: dict[str, Any] = {}
    specs: dict[str, dict[str, Any]] = {
        "batch": {"slo_class": "batch"},
        "interactive": {"slo_class": "interactive"},
        "trusted": {"slo_class": "standard", "min_priority": -5},
    }
    for name, spec in specs.items():
        created = admin.post("/admin/v1/api-keys", json={"tenant": name, **spec})
        assert created.status_code == 200, created.text
        keys[name] = created.json()
    try:
        batch, interactive = keys["batch"]["api_key"], keys["interactive"]["api_key"]
        trusted = keys["trusted"]["api_key"]
        assert keys["trusted"]["min_priority"] == -5
        assert _served_as(served, admin, batch, "interactive", -100) == ("batch", 0)
        assert _served_as(served, admin, batch, None, 3) == ("batch", 3)
        assert _served_as(served, admin, interactive, "batch", 0) == ("batch", 0)
        assert _served_as(served, admin, interactive, None, 0) == ("interactive", 0)
        assert _served_as(served, admin, trusted, "interactive", -100) == ("standard", -5)
        assert _served_as(served, admin, None, "interactive", -3) == ("interactive", -3)
        bad = admin.post("/admin/v1/api-keys", json={"tenant": "x", "min_priority": "high"})
        assert bad.status_code == 422
        metrics = admin.get("/metrics").text  # per tenant: the key's tenant, as served
        served_by = dict(
            re.findall(r'^superinfer:tenant_requests_total\{tenant="(\w+)"\} (\S+)$', metrics, re.M)
        )
        assert float(served_by["batch"]) >= 2 and float(served_by["interactive"]) >= 2
    finally:
        for created in keys.values():
            admin.delete(f"/admin/v1/api-keys/{created['key_id']}")


def test_deleting_a_key_ends_its_streams_in_flight(served: Served, admin: httpx.Client) -> None:
    """A revoked key's open streams kept generating to max_tokens; now every gateway ends them
    with a 401 key_revoked at its next refresh, and their workers drop them."""
    created = admin.post("/admin/v1/api-keys", json={"tenant": "leaked"}).json()
    headers = {"Authorization": f"Bearer {created['api_key']}"}
    body = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
    received: list[str] = []
    url = f"{served.url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for line in lines:
            received.append(line)
            if line.startswith("data: {"):
                break  # streaming: delete the key now
        deleted = admin.delete(f"/admin/v1/api-keys/{created['key_id']}")
        assert deleted.status_code == 200, deleted.text
        received.extend(lines)
    text = "\n".join(received)
    assert "key_revoked" in text, text[-500:]
    chunks = [line for line in received if line.startswith("data: {") and '"text"' in line]
    assert len(chunks) < 400  # ended, not served to max_tokens
