"""Admission and disconnects: a full queue answers 429 + Retry-After while accepted requests
complete; a client that goes away frees its request's KV blocks on the worker."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.served import Served, gateway

LONG = {"prompt": "Once", "max_tokens": 480, "ignore_eos": True, "temperature": 0}


async def _first_token(client: httpx.AsyncClient, url: str) -> asyncio.Task[int]:
    """Start a long streamed request and return once its first chunk arrived."""
    started = asyncio.Event()

    async def run() -> int:
        async with client.stream("POST", url, json={**LONG, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    started.set()
            return response.status_code

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), 30)
    return task


async def test_full_queue_gets_429_with_retry_after(served: Served, stories_path) -> None:
    # The two admitted wait behind the 4 running: on a busy host longer than the default 60 s
    # first-token floor (the count limit is what is tested here, not the deadline).
    env = {"SUPERINFER_MAX_QUEUED_REQUESTS": "2", "SUPERINFER_FIRST_TOKEN_TIMEOUT_S": "300"}
    with gateway(served.redis_url, str(stories_path), env) as small_url:
        async with httpx.AsyncClient(timeout=360) as client:
            # Fill the worker's 4 sequences through the main gateway, so later requests queue.
            running = [await _first_token(client, f"{served.url}/v1/completions") for _ in range(4)]
            body = {"prompt": "Tim", "max_tokens": 8, "temperature": 0}
            responses = await asyncio.gather(
                *(client.post(f"{small_url}/v1/completions", json=body) for _ in range(6))
            )
            statuses = sorted(r.status_code for r in responses)
            assert statuses == [200, 200, 429, 429, 429, 429], statuses
            for rejected in (r for r in responses if r.status_code == 429):
                assert int(rejected.headers["retry-after"]) >= 1
                assert rejected.json()["error"]["code"] == "queue_full"
            for accepted in (r for r in responses if r.status_code == 200):
                assert accepted.json()["usage"]["completion_tokens"] == 8
            assert await asyncio.gather(*running) == [200] * 4
            metrics = await client.get(f"{small_url}/metrics", headers=served.admin_headers)
            assert 'superinfer:requests_rejected_total{status="429"} 4.0' in metrics.text


def test_client_disconnect_frees_the_blocks(served: Served) -> None:
    admin = httpx.Client(base_url=served.url, headers=served.admin_headers, timeout=30)
    with httpx.stream(
        "POST", f"{served.url}/v1/completions", json={**LONG, "stream": True}, timeout=60
    ) as response:
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
    # The connection is closed mid-stream; the worker must drop the request.
    deadline = time.monotonic() + 10
    lifecycle: dict = {}
    while time.monotonic() < deadline:
        lifecycle = admin.get(f"/admin/v1/requests/{request_id}").json().get("lifecycle", {})
        (worker,) = admin.get("/admin/v1/workers").json()["workers"]
        if "finished_s" in lifecycle and worker["num_running"] == 0:
            break
        time.sleep(0.1)
    assert lifecycle.get("finish_reason") == "abort", lifecycle
    assert lifecycle.get("gateway_finish") == "abort"
    time.sleep(1.0)  # one heartbeat later the status shows the freed blocks
    (worker,) = admin.get("/admin/v1/workers").json()["workers"]
    assert worker["num_free_hbm_blocks"] == worker["num_hbm_blocks"]
    assert worker["num_running"] == worker["num_waiting"] == 0
