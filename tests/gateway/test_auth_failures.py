"""Failed authentications (gateway/auth_failures.py), on the gateway app in process over the
test Redis: counted in /metrics by kind, logged once per source per interval with a count,
slowed per source after the free ones (a good request from anywhere is not), 429 once too many
of a source's failures are waiting, and the sources kept bounded."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import httpx
from redis.asyncio import Redis
from structlog.testing import capture_logs

from gateway.auth_failures import AuthFailures, FailureRule
from tests.gateway.test_admin_validation import ADMIN, admin_client

WRONG = {"Authorization": "Bearer not-the-admin-token"}
FAST_S = 0.04  # the first delay is 0.05 s


def _client(app: Any, address: str, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(address, 1234))
    return httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers or {})


async def _timed(client: httpx.AsyncClient, path: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    response = await client.get(path)
    return response.status_code, time.perf_counter() - t0


async def test_wrong_admin_tokens_are_counted_logged_once_and_slowed(redis_client: Redis) -> None:
    app, admin = admin_client(auth_failures_free=3, auth_failure_max_delay_s=0.4)
    async with admin, _client(app, "10.0.0.7", WRONG) as attacker:
        with capture_logs() as logs:
            results = [await _timed(attacker, "/admin/v1/knobs") for _ in range(7)]
        assert [status for status, _ in results] == [401] * 7
        free, slowed = [s for _, s in results[:3]], [s for _, s in results[3:]]
        assert min(slowed) >= 0.05 * 0.9 and slowed[-1] >= 0.4 * 0.9, slowed
        assert sum(slowed) > 0.6 and max(free) < 0.5, (free, slowed)  # 0.05 + 0.1 + 0.2 + 0.4
        status, good_s = await _timed(admin, "/admin/v1/knobs")  # the right token: at once
        assert status == 200 and good_s < 0.4, good_s
        metrics = (await admin.get("/metrics")).text
        assert 'superinfer:auth_failures_total{kind="admin"} 7.0' in metrics
    lines = [entry for entry in logs if entry["event"] == "auth_failures"]
    assert len(lines) == 1 and lines[0]["source"] == "10.0.0.7" and lines[0]["kind"] == "admin"
    assert ADMIN not in str(logs) and "not-the-admin-token" not in str(logs)
    await app.state.gateway.redis.aclose()


async def test_missing_and_unknown_api_keys_are_counted_and_slowed(redis_client: Redis) -> None:
    app, admin = admin_client(
        require_api_key=True, auth_failures_free=1, auth_failure_max_delay_s=0.2
    )
    wrong = {"Authorization": "Bearer sk-si-" + "x" * 43}
    async with admin, _client(app, "10.0.0.8", wrong) as client:
        results = [await _timed(client, "/v1/models") for _ in range(3)]
        assert [status for status, _ in results] == [401] * 3
        assert results[2][1] >= 0.1 * 0.9, results
        metrics = (await admin.get("/metrics")).text
        assert 'superinfer:auth_failures_total{kind="api_key"} 3.0' in metrics
    await app.state.gateway.redis.aclose()


async def test_a_good_client_is_not_slowed_while_a_source_spams(redis_client: Redis) -> None:
    app, admin = admin_client(auth_failures_free=2, auth_failure_max_delay_s=1.0)
    async with admin, _client(app, "10.0.0.9", WRONG) as attacker:
        quiet = [(await _timed(admin, "/admin/v1/knobs"))[1] for _ in range(20)]

        async def spam() -> int:
            count = 0
            while not stop.is_set():
                await attacker.get("/admin/v1/knobs")
                count += 1
            return count

        stop = asyncio.Event()
        spammers = [asyncio.create_task(spam()) for _ in range(16)]
        await asyncio.sleep(0.3)
        busy = [(await _timed(admin, "/admin/v1/knobs"))[1] for _ in range(20)]
        stop.set()
        sent = sum(await asyncio.gather(*spammers))
    quiet_ms, busy_ms = statistics.median(quiet) * 1e3, statistics.median(busy) * 1e3
    print(f"good median {quiet_ms:.1f} ms quiet, {busy_ms:.1f} ms under 16 spammers ({sent} sent)")
    assert busy_ms < max(5 * quiet_ms, 50.0), (quiet_ms, busy_ms)
    assert sent < 16 * 4, sent  # held: about one failure per connection per second
    await app.state.gateway.redis.aclose()


async def test_too_many_waiting_failures_of_a_source_are_429(redis_client: Redis) -> None:
    app, admin = admin_client()
    counter = app.state.gateway.metrics.auth_failures
    app.state.gateway.auth_failures = AuthFailures(
        counter, FailureRule(free=0, max_delay_s=0.5, max_waiting_per_source=2)
    )
    async with admin, _client(app, "10.0.0.10", WRONG) as attacker:
        responses = await asyncio.gather(*(attacker.get("/admin/v1/knobs") for _ in range(6)))
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [401, 401, 429, 429, 429, 429], statuses
        throttled = next(r for r in responses if r.status_code == 429)
        assert throttled.headers["retry-after"] == "1"
        assert throttled.json()["error"]["code"] == "auth_throttled"
    await app.state.gateway.redis.aclose()


async def test_the_sources_stay_bounded(redis_client: Redis) -> None:
    app, admin = admin_client()
    tracker = AuthFailures(app.state.gateway.metrics.auth_failures, FailureRule(max_sources=4))
    app.state.gateway.auth_failures = tracker
    async with admin:
        for i in range(10):
            async with _client(app, f"10.1.0.{i}", WRONG) as client:
                assert (await client.get("/admin/v1/knobs")).status_code == 401
    assert tracker.num_sources == 4
    await app.state.gateway.redis.aclose()
