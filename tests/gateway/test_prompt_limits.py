"""Prompts cannot stall the gateway: the API key is checked before anything is tokenized, text
over ``max_prompt_chars`` is a 400 before tokenizing, tokenizing (any tokenizer) runs on a
worker thread, and /health answers within 1 s while maximum-size prompts are tokenized."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from shared.tokenizer import ByteTokenizer
from tests.served import Served

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside. "
LANES = ["application/json", "application/vnd.api+json"]  # the fast lane, FastAPI's router
NO_REDIS = "redis://127.0.0.1:1/0"  # nothing listens: only what needs no Redis can pass


def _app(model: str, **settings: Any) -> FastAPI:
    defaults: dict[str, Any] = {"redis_url": NO_REDIS, "admin_disabled": True}
    return create_app(GatewaySettings(model=model, **{**defaults, **settings}))


def _state(app: FastAPI) -> GatewayState:
    state: GatewayState = app.state.gateway
    return state


@pytest.fixture
async def client_for() -> AsyncIterator[Any]:
    """``client_for(app)``: an httpx client on the app in process (no lifespan: no Redis)."""
    clients: list[httpx.AsyncClient] = []

    def make(app: FastAPI) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=app)
        clients.append(httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30))
        return clients[-1]

    yield make
    for client in clients:
        await client.aclose()


class RecordingTokenizer(ByteTokenizer):
    """Notes the thread each encode ran on."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return super().encode(text, add_bos)


@pytest.mark.parametrize("content_type", LANES)
async def test_the_key_is_checked_before_tokenizing(client_for: Any, content_type: str) -> None:
    app = _app("tiny-random", require_api_key=True)
    tokenizer = RecordingTokenizer()
    _state(app).prompts.tokenizer = tokenizer
    client = client_for(app)
    headers = {"content-type": content_type}
    for path, body in [
        ("/v1/completions", b'{"prompt": "' + b"a" * 500_000 + b'"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}'),
    ]:
        response = await client.post(path, content=body, headers=headers)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert tokenizer.threads == []  # nothing was tokenized for an unauthenticated caller


@pytest.mark.parametrize("content_type", LANES)
async def test_tokenizing_runs_on_a_worker_thread(client_for: Any, content_type: str) -> None:
    app = _app("tiny-random")
    tokenizer = RecordingTokenizer()
    _state(app).prompts.tokenizer = tokenizer
    client = client_for(app)
    headers = {"content-type": content_type}
    await client.post("/v1/completions", content=b'{"prompt": "Once"}', headers=headers)
    chat = b'{"messages": [{"role": "user", "content": "hi"}]}'
    await client.post("/v1/chat/completions", content=chat, headers=headers)
    assert len(tokenizer.threads) == 2
    assert all(name.startswith("tokenize") for name in tokenizer.threads), tokenizer.threads
    assert threading.current_thread().name not in tokenizer.threads


@pytest.mark.parametrize("content_type", LANES)
async def test_text_over_the_cap_is_a_400_before_tokenizing(
    client_for: Any, content_type: str, stories_path: Path
) -> None:
    app = _app(str(stories_path), max_prompt_chars=1000)
    client = client_for(app)
    headers = {"content-type": content_type}
    too_long = [
        ("/v1/completions", {"prompt": "a" * 1001}, "prompt"),
        ("/v1/completions", {"prompt": ["a" * 1001]}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a" * 1001}]},
            "messages",
        ),
        # 990 characters of content, over 1000 once the default template wrote the roles
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a" * 990}]},
            "messages",
        ),
    ]
    for path, body, param in too_long:
        response = await client.post(path, json=body, headers=headers)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("prompt_too_long", param)
        assert "at most 1000" in error["message"]
    at_cap = await client.post("/v1/completions", json={"prompt": "a" * 1000}, headers=headers)
    # tokenized and past validation: the 503 says the bus (nothing listens on NO_REDIS)
    assert (at_cap.status_code, at_cap.json()["error"]["code"]) == (503, "bus")


async def _health_latencies(url: str, stop: asyncio.Event) -> list[float]:
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=1.0) as client:
        while not stop.is_set():
            started = time.monotonic()
            response = await client.get(f"{url}/health")  # a ReadTimeout fails the test
            assert response.status_code == 200
            latencies.append(time.monotonic() - started)
            await asyncio.sleep(0.05)
    return latencies


async def test_health_answers_while_maximum_size_prompts_are_tokenized(served: Served) -> None:
    """Two prompts as long as the default limits let through (the body limit: 1 MiB) at once:
    the reference tokenizer would take hours each, on the event loop; now about a second each
    on the tokenizer threads, while /health keeps answering."""
    size = 1_048_576 - 64
    prompt = (STORY * (size // len(STORY) + 1))[:size]
    stop = asyncio.Event()
    health = asyncio.create_task(_health_latencies(served.url, stop))
    await asyncio.sleep(0.2)
    async with httpx.AsyncClient(timeout=120) as client:
        started = time.monotonic()
        responses = await asyncio.gather(
            *(client.post(f"{served.url}/v1/completions", json={"prompt": prompt}) for _ in "ab")
        )
        in_flight_s = time.monotonic() - started
    stop.set()
    latencies = await health
    for response in responses:
        assert response.status_code == 400, response.text[:300]
        assert response.json()["error"]["code"] == "context_length_exceeded"
    print(f"2 prompts of {size} chars: {in_flight_s:.2f} s; {len(latencies)} health checks, ")
    print(f"slowest {max(latencies) * 1000:.0f} ms")
    assert len(latencies) >= 3 and max(latencies) < 1.0


async def test_a_short_prompt_does_not_queue_behind_long_ones(served: Served) -> None:
    """Three half-megabyte prompts are tokenized when a short request comes: it is answered
    before any of them (it waited for one of them, behind them in the tokenizer threads'
    queue, before short prompts got a thread of their own)."""
    size = 524_288
    prompt = (STORY * (size // len(STORY) + 1))[:size]
    done_s: dict[str, float] = {}
    async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:

        async def post(name: str, body: dict[str, Any]) -> httpx.Response:
            response = await client.post("/v1/completions", json=body)
            done_s[name] = time.monotonic()
            return response

        longs = [asyncio.create_task(post(f"long{i}", {"prompt": prompt})) for i in range(3)]
        await asyncio.sleep(0.3)  # the long ones are in the tokenizer threads
        short = await post("short", {"prompt": "Tim", "max_tokens": 2, "temperature": 0})
        assert short.status_code == 200, short.text
        responses = await asyncio.gather(*longs)
    assert all(r.status_code == 400 for r in responses)
    assert done_s["short"] < min(t for name, t in done_s.items() if name != "short"), done_s
