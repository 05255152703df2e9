"""Deadlines that mean something (issue 30 item 4): the first token is allowed its predicted
prefill, counted from admission, and admission is bounded in predicted seconds of prefill, so
a long prompt completes or is refused at once, and under a burst every admitted request
completes while the rest get 429 + Retry-After at once.

tiny-random (its context is 4096 tokens, not the issue's 8,000) in 32-token steps, so that a
4,000-token prompt's prefill takes seconds, with a 1 s first-token floor and a 3 s gap bound:
the old fixed timeout, counting prefill and queueing, ends these requests with 504. The rate
is measured on short prompts, so it predicts long ones too fast (7,700 tokens/s measured, a
4,000-token prefill at ~1,900): the slack covers that."""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest

from data_plane.speed import SpeedMeter
from gateway.errors import APIError
from gateway.settings import GatewaySettings
from gateway.workers import WorkerDirectory
from shared.policy import Plan
from shared.policy.types import ScheduledChunk
from shared.protocol import WorkerStatus
from tests.served import Served, embedded_redis, serve

MAX_QUEUED_WORK_S = 3.0
FIRST_TOKEN_FLOOR_S = 1.0
ENV = {
    "SUPERINFER_FIRST_TOKEN_TIMEOUT_S": str(FIRST_TOKEN_FLOOR_S),
    "SUPERINFER_TOKEN_TIMEOUT_S": "3",  # the old code's bound on the first token too
    "SUPERINFER_MAX_QUEUED_WORK_S": str(MAX_QUEUED_WORK_S),
}
ARGS = ["--model", "tiny-random", "--max-model-len", "4096", "--max-num-batched-tokens", "32"]
LONG_TOKENS = 4000  # bytes: tiny-random's tokenizer makes a token of each
NUM_LONG = 10  # 40,000 prompt tokens: over the 3 s bound below 13,000 tokens/s (7,700 seen)
BURST = 300
BURST_FLOOR_S = 8.0


@pytest.fixture(scope="module")
def slow_prefill() -> Iterator[Served]:
    with embedded_redis() as redis_url, serve(ARGS, redis_url, ENV) as system:
        _measure_speed(system)
        yield system


@pytest.fixture(scope="module")
def burst_server() -> Iterator[Served]:
    """As slow_prefill, with an 8 s first-token floor: with 1 s, requests admitted first (little
    queued ahead, so little allowance) failed at 3.8-4.9 s while the gateway, on the same two
    cores, took the burst's 300 connections (a full run here), and with 5 s at 5.2-6.1 s in a
    clean CI run; the product's floor is 60 s."""
    env = {**ENV, "SUPERINFER_FIRST_TOKEN_TIMEOUT_S": str(BURST_FLOOR_S)}
    with embedded_redis() as redis_url, serve(ARGS, redis_url, env) as system:
        _measure_speed(system)
        yield system


def _prompt(num_chars: int) -> str:
    """Random letters: no prefix-cache hit between prompts."""
    return "".join(random.choices(string.ascii_letters, k=num_chars))


def _measure_speed(system: Served) -> None:
    """One request, so that the worker has measured its prefill rate (heartbeats carry it)."""
    body = {"prompt": _prompt(400), "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{system.url}/v1/completions", json=body, timeout=60).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _worker(system)["prefill_tokens_per_s"] > 0:
            return
        time.sleep(0.2)
    raise TimeoutError("the worker reported no prefill rate")


def _worker(system: Served) -> dict[str, float]:
    response = httpx.get(f"{system.url}/admin/v1/workers", headers=system.admin_headers)
    (worker,) = response.json()["workers"]
    return dict(worker)


@dataclass
class _Result:
    """One streamed completion: its status, error code, Retry-After, tokens and timing."""

    status: int = 0
    code: str | None = None  # the error's (HTTP body or SSE error event)
    retry_after_s: int = 0
    num_tokens: int = 0  # the final usage chunk's
    finish_reason: str | None = None
    done: bool = False  # data: [DONE] seen
    elapsed_s: float = 0.0

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.code is None and self.done and bool(self.finish_reason)


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> _Result:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    result, t_start = _Result(), time.monotonic()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.code = json.loads(await response.aread())["error"]["code"]
            result.retry_after_s = int(response.headers.get("retry-after", 0))
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                result.done = True
            elif line.startswith("data: {"):
                _read_event(json.loads(line[6:]), result)
    result.elapsed_s = time.monotonic() - t_start
    return result


def _read_event(event: dict[str, Any], result: _Result) -> None:
    if "error" in event:
        result.code = str(event["error"].get("code"))
    elif event.get("usage"):
        result.num_tokens = int(event["usage"]["completion_tokens"])
    elif event["choices"][0].get("finish_reason"):
        result.finish_reason = event["choices"][0]["finish_reason"]


async def test_long_prompts_get_their_predicted_prefill_or_429_at_once(
    slow_prefill: Served,
) -> None:
    """Ten 4,000-token prompts at once: those within the work bound are admitted and all
    complete, each allowed its predicted prefill and the queue's ahead of it (the last ones
    wait seconds past the 1 s floor: the floor alone was a 504); the rest get 429 at once."""
    async with httpx.AsyncClient(base_url=slow_prefill.url, timeout=120) as client:
        outcomes = await asyncio.gather(
            *(_stream(client, _prompt(LONG_TOKENS), 4) for _ in range(NUM_LONG))
        )
    rate = _worker(slow_prefill)["prefill_tokens_per_s"]
    admitted, refused = _admitted_and_refused(outcomes)
    slowest_s = max((o.elapsed_s for o in admitted), default=0.0)
    print(
        f"{NUM_LONG} 4,000-token prompts: {len(admitted)} admitted, the slowest done in "
        f"{slowest_s:.1f} s; {len(refused)} got 429 ({rate:.0f} prompt tokens/s measured)"
    )
    assert len(admitted) + len(refused) == NUM_LONG
    _check_served_or_refused(admitted, refused, 4)
    assert slowest_s > FIRST_TOKEN_FLOOR_S  # past the floor: only the allowance kept it
    assert max(o.elapsed_s for o in refused) < 2.0  # at once, not a minute later


def _admitted_and_refused(outcomes: list[_Result]) -> tuple[list[_Result], list[_Result]]:
    return [o for o in outcomes if o.status == 200], [o for o in outcomes if o.status == 429]


def _check_served_or_refused(
    admitted: list[_Result], refused: list[_Result], num_tokens: int
) -> None:
    """Every request admitted or refused (both happened); each admitted one complete with
    its tokens, each refused one a 429 queue_full with Retry-After."""
    assert admitted and refused
    failed = [o for o in admitted if not (o.completed and o.num_tokens == num_tokens)]
    assert not failed, failed[:3]
    assert all(o.code == "queue_full" and o.retry_after_s >= 1 for o in refused), refused[:3]


async def test_a_burst_every_admitted_request_completes(burst_server: Served) -> None:
    limits = httpx.Limits(max_connections=BURST + 4)
    async with httpx.AsyncClient(base_url=burst_server.url, timeout=120, limits=limits) as client:
        t_start = time.monotonic()
        outcomes = await asyncio.gather(*(_stream(client, _prompt(100), 8) for _ in range(BURST)))
    admitted, refused = _admitted_and_refused(outcomes)
    slowest_refusal_s = max((o.elapsed_s for o in refused), default=0.0)
    print(
        f"{BURST} streams: {len(admitted)} admitted, {len(refused)} got 429 (slowest "
        f"{slowest_refusal_s:.2f} s), all done in {time.monotonic() - t_start:.1f} s"
    )
    assert len(admitted) + len(refused) == BURST
    _check_served_or_refused(admitted, refused, 8)
    assert slowest_refusal_s < 10.0  # at once (300 connections on a busy host), no 504 later


def test_the_speed_meter_measures_prefill_and_decode_steps() -> None:
    meter = SpeedMeter(alpha=0.5)
    assert meter.prefill_tokens_per_s == meter.decode_step_s == 0.0  # nothing measured yet
    mixed = Plan(schedule=[ScheduledChunk("d", 1), ScheduledChunk("p", 300)])
    meter.observe(mixed, 0.5)  # the decode shares the step: the prefill rate sees its cost
    assert meter.prefill_tokens_per_s == pytest.approx(600.0)
    meter.observe(Plan(schedule=[ScheduledChunk("p", 100)]), 0.5)  # EWMAs: 200/0.5
    assert meter.prefill_tokens_per_s == pytest.approx(400.0) and meter.decode_step_s == 0.0
    meter.observe(Plan(schedule=[ScheduledChunk("a", 1), ScheduledChunk("b", 1)]), 0.02)
    meter.observe(Plan(schedule=[ScheduledChunk("a", 1)]), 0.04)
    meter.observe(Plan(), 1.0)  # nothing computed (waiting for a copy): no measure
    assert meter.decode_step_s == pytest.approx(0.03)
    assert meter.prefill_tokens_per_s == pytest.approx(400.0)


def _directory(**settings: Any) -> WorkerDirectory:
    redis: Any = None  # never touched: the statuses are set as a refresh would
    directory = WorkerDirectory(redis, GatewaySettings(admin_disabled=True, **settings))
    status = WorkerStatus(
        "w0", "e1", time.time(), "m", 4096, 0, 0, 0, 0, 100, 100, 0, 0, 2048, 0.05, "local",
        "vllm", 0, 0, 0, 0, 0, True, prefill_tokens_per_s=1000.0,
    )  # fmt: skip
    directory.statuses = {"w0": status}
    return directory


def test_admission_is_bounded_in_predicted_seconds_of_prefill() -> None:
    directory = _directory(max_queued_work_s=2.0, retry_after_s=1)
    assert directory.choose(5000).worker_id == "w0"  # 5 s, but the queue is idle
    directory.enqueue("w0", 5000)
    with pytest.raises(APIError) as refused:
        directory.choose(10)  # 5.01 s of prefill queued: over 2 s
    assert refused.value.status_code == 429 and refused.value.code == "queue_full"
    assert refused.value.headers == {"Retry-After": "4"}  # 3.01 s over the bound
    directory.dequeue("w0", 5000)
    directory.enqueue("w0", 1500)
    assert directory.choose(400).worker_id == "w0"  # 1.9 s: within the bound
    with pytest.raises(APIError):
        directory.choose(600)
    # The worker's own count of waiting tokens (other gateways' requests) counts when larger.
    directory.statuses["w0"] = replace(directory.statuses["w0"], num_waiting_tokens=3000)
    assert directory.queued_prefill_tokens(directory.statuses["w0"]) == 3000
    with pytest.raises(APIError):
        directory.choose(10)
    # A worker with no measured rate yet is bounded by the counts alone.
    directory.statuses["w0"] = replace(directory.statuses["w0"], prefill_tokens_per_s=0.0)
    assert directory.choose(10).worker_id == "w0" and directory.prefill_s("w0", 10**6) == 0.0


def test_no_worker_is_503_with_retry_after() -> None:
    directory = _directory(retry_after_s=3)
    directory.statuses = {}
    with pytest.raises(APIError) as refused:
        directory.choose(10)
    assert refused.value.status_code == 503 and refused.value.headers == {"Retry-After": "3"}
