"""What a caller can see: a 5xx body is generic (a message for its status, our code, a request
id) on both lanes, its detail only in the log under that id; with ``require_api_key`` only
/health and /ready are open: /openapi.json needs a key or the admin token, /docs and /redoc are
off, /metrics needs the admin or the metrics token (as it does whenever that one is set)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis
from structlog.testing import capture_logs

from gateway.app import create_app
from gateway.auth import KEY_PREFIX, create_api_key
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from tests.redis_support import redis_url

LANES = ["application/json", "application/vnd.api+json"]  # the fast lane, FastAPI's router
NO_REDIS = "redis://127.0.0.1:1/0"  # nothing listens there
ADMIN = "test-admin-token"
GENERIC = re.compile(r"^[a-z ;:]+ \(request id (err-[0-9a-f]{32})\)$")


def _app(**settings: Any) -> FastAPI:
    base: dict[str, Any] = {"model": "tiny-random", "redis_url": NO_REDIS, "admin_token": ADMIN}
    return create_app(GatewaySettings(**{**base, **settings}))


@pytest.fixture
async def client_for() -> AsyncIterator[Any]:
    """``client_for(app)``: an httpx client on the app in process (no lifespan)."""
    clients: list[httpx.AsyncClient] = []

    def make(app: FastAPI) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        clients.append(httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30))
        return clients[-1]

    yield make
    for client in clients:
        await client.aclose()


def _check_generic(response: httpx.Response, status: int, code: str, logs: list[Any]) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    match = GENERIC.match(error["message"])
    assert match is not None, error
    assert (error["type"], error["code"], error["param"]) == (
        "service_unavailable" if status == 503 else "server_error",
        code,
        None,
    )
    request_id = match.group(1)
    assert response.headers["x-request-id"] == request_id
    logged = [entry for entry in logs if entry.get("request_id") == request_id]
    assert len(logged) == 1 and logged[0]["log_level"] == "error"
    return str(logged[0]["detail"])


@pytest.mark.parametrize("content_type", LANES)
async def test_an_unreachable_redis_is_not_shown_to_the_caller(
    client_for: Any, content_type: str
) -> None:
    client = client_for(_app(redis_timeout_s=1.0))
    headers = {"content-type": content_type, "authorization": f"Bearer {KEY_PREFIX}{'a' * 43}"}
    with capture_logs() as logs:
        response = await client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
    detail = _check_generic(response, 503, "bus", logs)
    assert "could not check the API key" in detail  # with Redis's own words, in the log only
    assert response.headers["retry-after"] == "1"  # as every 503: the client backs off
    assert "redis" not in response.text.lower() and "connect" not in response.text.lower()


@pytest.mark.parametrize("content_type", LANES)
async def test_an_unexpected_error_is_a_generic_500(
    client_for: Any, content_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _app()
    state: GatewayState = app.state.gateway

    async def broken(prompt: Any) -> list[int]:
        raise RuntimeError("secret-internal-detail")

    monkeypatch.setattr(state.prompts, "completion", broken)
    client = client_for(app)
    with capture_logs() as logs:
        response = await client.post(
            "/v1/completions", json={"prompt": "x"}, headers={"content-type": content_type}
        )
    detail = _check_generic(response, 500, "internal_error", logs)
    assert detail == "RuntimeError: secret-internal-detail"
    assert "secret" not in response.text and "RuntimeError" not in response.text


async def test_with_keys_required_only_health_and_ready_are_open(client_for: Any) -> None:
    client = client_for(_app(require_api_key=True, metrics_token="scrape-token"))
    admin = {"authorization": f"Bearer {ADMIN}"}
    for path in ("/docs", "/redoc"):
        assert (await client.get(path)).status_code == 404
        assert (await client.get(path, headers=admin)).status_code == 404
    assert (await client.get("/openapi.json")).status_code == 401
    assert (await client.get("/openapi.json", headers=admin)).json()["info"]["title"]
    assert (await client.get("/v1/models")).status_code == 401
    assert (await client.get("/metrics")).status_code == 401
    wrong = {"authorization": "Bearer not-a-token"}
    assert (await client.get("/metrics", headers=wrong)).status_code == 401
    scraper = {"authorization": "Bearer scrape-token"}
    for headers in (admin, scraper):
        response = await client.get("/metrics", headers=headers)
        assert response.status_code == 200 and "superinfer" in response.text
    assert (await client.get("/health")).status_code == 200


async def test_an_api_key_opens_the_schema(client_for: Any, redis_client: Redis) -> None:
    client = client_for(_app(require_api_key=True, redis_url=redis_url()))
    key, _ = await create_api_key(redis_client, "acme", None)
    response = await client.get("/openapi.json", headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200 and "/v1/completions" in response.json()["paths"]


async def test_open_mode_keeps_docs_and_metrics_open(client_for: Any) -> None:
    client = client_for(_app())
    for path in ("/docs", "/openapi.json", "/metrics"):
        assert (await client.get(path)).status_code == 200, path
    guarded = client_for(_app(metrics_token="scrape-token"))
    assert (await guarded.get("/metrics")).status_code == 401  # a metrics token is always needed
