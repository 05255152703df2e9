"""SSE keep-alive: a stream that waits for its next output (queued for its first token, or a
gap between tokens) gets ``: keep-alive`` comments every ``sse_keepalive_s``, which the openai
client skips; the token timeout still counts from the start of the wait."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from gateway.errors import APIError
from gateway.generation import KEEPALIVE, Generation, GenerationParams
from gateway.inflight import InFlight, Route
from gateway.limits import KeyLimiter
from gateway.placement import Placement
from gateway.settings import GatewaySettings
from shared.protocol import TokenOutput
from shared.sampling import SamplingParams
from shared.slo import SloClass
from shared.tokenizer import ByteTokenizer
from tests.served import Served

MODEL = "stories260K"
FILLER = {"prompt": "Once", "max_tokens": 480, "ignore_eos": True, "temperature": 0}


class _Service:
    """What a Generation uses of its GenerationService."""

    def __init__(self, token_timeout_s: float) -> None:
        self.settings = GatewaySettings(admin_disabled=True, token_timeout_s=token_timeout_s)
        self.tokenizer = ByteTokenizer()
        self.directory = SimpleNamespace(enqueue=lambda *_: None, dequeue=lambda *_: None)
        self.num_finished = 0

    def finish(self, _: Generation) -> None:
        self.num_finished += 1

    def observe_tokens(self, *_: object) -> None:
        pass  # no metrics here


def _generation(token_timeout_s: float) -> tuple[Generation, InFlight, _Service]:
    service = _Service(token_timeout_s)
    params = GenerationParams([1, 2], SamplingParams(8), SloClass("standard", 5.0, 0.1))
    service_any: Any = service
    placement = Placement(service_any.directory, KeyLimiter(4, 4.0), "w", 2, None)
    record = InFlight("r", Route("w", "e1", "r"), placement, 0, 0.0)
    return Generation(service_any, record, params), record, service


def _tokens(text: str) -> list[int]:
    return ByteTokenizer().encode(text, add_bos=False)


async def test_keepalives_while_queued_and_in_a_gap_between_tokens() -> None:
    generation, record, service = _generation(token_timeout_s=5.0)

    async def worker() -> None:
        await asyncio.sleep(0.35)  # queued: about 3 keep-alives
        record.outputs.put(TokenOutput("r", 0, _tokens("Hi")))
        await asyncio.sleep(0.25)  # a gap: about 2 more
        record.outputs.put(TokenOutput("r", 2, _tokens("!"), finish_reason="length"))

    feeding = asyncio.create_task(worker())
    seen = ["K" if d is KEEPALIVE else d.text async for d in generation.deltas(0.1)]
    await feeding
    assert "".join(seen).replace("K", "") == "Hi!"
    hi = seen.index("Hi")
    assert hi >= 2 and "K" in seen[hi:], seen
    assert service.num_finished == 1


async def test_the_token_timeout_counts_across_keepalives() -> None:
    generation, _, _ = _generation(token_timeout_s=0.5)
    num_keepalives, start = 0, time.monotonic()
    with pytest.raises(APIError) as timed_out:
        async for delta in generation.deltas(0.1):
            assert delta is KEEPALIVE
            num_keepalives += 1
    assert timed_out.value.status_code == 504
    assert 0.45 <= time.monotonic() - start < 2.0 and num_keepalives >= 3


async def test_no_keepalives_unless_asked() -> None:
    generation, record, _ = _generation(token_timeout_s=5.0)
    asyncio.get_running_loop().call_later(
        0.3, record.outputs.put, TokenOutput("r", 0, _tokens("ok"), finish_reason="length")
    )
    assert [d.text async for d in generation.deltas()] == ["ok"]


async def _running(client: httpx.AsyncClient, url: str) -> asyncio.Task[None]:
    """A long streamed request, once its first token came (it holds one of the 4 seats)."""
    started = asyncio.Event()

    async def run() -> None:
        async with client.stream("POST", url, json={**FILLER, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    started.set()

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), 60)
    return task


async def test_a_queued_stream_sends_keepalives_before_its_first_token(
    served: Served, tuned_gateway: str
) -> None:
    lines: list[str] = []
    two_keepalives = asyncio.Event()
    body = {"prompt": "Tim", "max_tokens": 4, "temperature": 0, "stream": True}

    async def raw(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", f"{tuned_gateway}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                lines.append(line)
                if lines.count(": keep-alive") >= 2:
                    two_keepalives.set()

    async def parsed() -> list[Any]:
        openai = AsyncOpenAI(base_url=f"{tuned_gateway}/v1", api_key="-", max_retries=0)
        stream = await openai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tim"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"chat_template_kwargs": {"story": "Lily"}},
        )
        return [chunk async for chunk in stream]

    async with httpx.AsyncClient(timeout=120) as client:
        # The worker runs 4 sequences: with 4 long ones running, the next requests queue.
        fillers = [await _running(client, f"{served.url}/v1/completions") for _ in range(4)]
        queued = asyncio.gather(raw(client), parsed())
        await asyncio.wait_for(two_keepalives.wait(), 30)
        for filler in fillers:  # their clients leave: the queued requests get the seats
            filler.cancel()
        await asyncio.gather(*fillers, return_exceptions=True)
        _, chunks = await asyncio.wait_for(queued, 60)
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert lines[:first_data].count(": keep-alive") >= 2, lines[:first_data]
    assert "data: [DONE]" in lines[first_data:]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
