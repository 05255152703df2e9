"""A refused request fails alone and leaves nothing behind: every choice submitted before the
refusal is ended (a batch whose k-th prompt found the queue full, an echo of ids the tokenizer
does not know, a client gone while n > 1 waited for its first sample) so the gateway keeps
serving; a field the worker refuses is named in the 400's ``param``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import httpx
import psutil

from tests.served import Served, gateway

SMALL_QUEUE = {"SUPERINFER_MAX_QUEUED_REQUESTS": "3", "SUPERINFER_FIRST_TOKEN_TIMEOUT_S": "300"}
TINY = {"prompt": "Tim", "max_tokens": 4, "temperature": 0}


def _counter(metrics: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_a_refused_batch_or_echo_leaves_the_queue_free(served: Served, stories_path) -> None:
    with gateway(served.redis_url, str(stories_path), SMALL_QUEUE) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            batch = {**TINY, "prompt": ["Tim", "Sue", "Ben", "Max"] * 2}  # 8 prompts, 3 places
            refused = await client.post("/v1/completions", json=batch)
            assert refused.status_code == 429, refused.text
            for _ in range(4):  # echo of an id past the vocabulary: refused before any submit
                body = {"prompt": [1, 99_999], "echo": True, "max_tokens": 1}
                bad = await client.post("/v1/completions", json=body)
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
            # The three places are free again (they leaked: every request was a 429 after).
            responses = await asyncio.gather(
                *(client.post("/v1/completions", json=TINY) for _ in range(3))
            )
            assert [r.status_code for r in responses] == [200] * 3, responses[0].text


async def test_refusals_name_the_field(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
        bodies = {
            "stop_token_ids": {**TINY, "stop_token_ids": [10**6]},
            "logit_bias": {**TINY, "logit_bias": {str(10**6): 5}},
            "min_tokens": {**TINY, "min_tokens": 9},
        }
        for (param, body), stream in itertools.product(bodies.items(), (False, True)):
            # refused before a stream starts (it was a 200, then an error event)
            response = await client.post("/v1/completions", json={**body, "stream": stream})
            assert response.status_code == 400, (param, response.text)
            assert response.json()["error"]["param"] == param, response.text
        chat = {"messages": [{"role": "user", "content": "Tim " * 2000}], "max_tokens": 1}
        too_long = await client.post("/v1/chat/completions", json=chat)
        assert too_long.status_code == 400
        assert too_long.json()["error"]["param"] in ("messages", "max_tokens"), too_long.text


async def test_n_samples_are_not_submitted_for_a_client_gone(served: Served, stories_path) -> None:
    """An n=3 request's first sample waits (the worker is paused, shorter than the gateway's
    3 s to call it dead); its client leaves: that sample is aborted at once and no sibling is
    ever submitted (they were, once the first sample's first token came)."""
    (worker,) = [
        p
        for p in psutil.Process(served.process.pid).children(recursive=True)
        if "data-plane" in " ".join(p.cmdline())
    ]
    with gateway(served.redis_url, str(stories_path), SMALL_QUEUE) as url:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {**TINY, "n": 3, "temperature": 1.0, "seed": 7}
            worker.suspend()
            try:
                with contextlib.suppress(httpx.TimeoutException):  # it leaves while paused
                    await client.post(f"{url}/v1/completions", json=body, timeout=0.6)
                await asyncio.sleep(0.9)  # the gateway sees it gone (it asks every 0.5 s)
            finally:
                worker.resume()
            await asyncio.sleep(2.0)  # a first token would have come by now, and siblings
            metrics = (await client.get(f"{url}/metrics", headers=served.admin_headers)).text
    assert _counter(metrics, "superinfer:request_success_total", finished_reason="abort") == 1
    for reason in ("length", "stop"):  # no sibling ran (their series exist, at 0)
        assert _counter(metrics, "superinfer:request_success_total", finished_reason=reason) == 0
        assert _counter(metrics, "vllm:request_success_total", finished_reason=reason) == 0
