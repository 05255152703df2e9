"""``stream_options`` as vLLM serves it (guidellm streams every request with
``continuous_usage_stats``): usage in every chunk with that choice's running counts, the final
usage by default, ``include_usage`` false or null for none; and vLLM's wider value ranges."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.served import Served

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
API_JSON = {"content-type": "application/vnd.api+json"}  # JSON, but not for the fast lane
BASE: dict[str, dict[str, Any]] = {
    CHAT: {"messages": [{"role": "user", "content": "Tim"}], "max_tokens": 6},
    COMPLETIONS: {"prompt": "Tim had a", "max_tokens": 6},
}
MAX_TOKENS = 6


def _post(served: Served, path: str, body: dict[str, Any], fast: bool) -> httpx.Response:
    """Through the fast lane (``application/json``) or FastAPI's route (another JSON type)."""
    headers = None if fast else API_JSON
    content = json.dumps(body).encode()
    headers = headers or {"content-type": "application/json"}
    return httpx.post(f"{served.url}{path}", content=content, headers=headers, timeout=60)


def _chunks(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_continuous_usage_counts_each_choice(served: Served, path: str) -> None:
    """Two choices of 6 tokens each (ignore_eos): every chunk's usage is its own choice's
    count so far, rising to 6; the final chunk sums both, as the whole response's usage."""
    body = {**BASE[path], "n": 2, "temperature": 0, "ignore_eos": True}
    whole = _post(served, path, body, fast=True).json()["usage"]
    options = {"include_usage": True, "continuous_usage_stats": True}
    for fast in (True, False):
        streamed = {**body, "stream": True, "stream_options": options}
        chunks = _chunks(_post(served, path, streamed, fast))
        *deltas, last = chunks
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * MAX_TOKENS
        assert last["usage"]["prompt_tokens"] == whole["prompt_tokens"]
        assert last["usage"]["completion_tokens"] == whole["completion_tokens"]
        seen: dict[int, list[int]] = {0: [], 1: []}
        for chunk in deltas:
            (choice,) = chunk["choices"]
            running = chunk["usage"]
            assert running["prompt_tokens"] == whole["prompt_tokens"], chunk
            total = running["prompt_tokens"] + running["completion_tokens"]
            assert running["total_tokens"] == total
            seen[choice["index"]].append(running["completion_tokens"])
        for counts in seen.values():
            assert counts == sorted(counts) and counts[-1] == MAX_TOKENS, seen


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stream_options_defaults_are_vllms(served: Served, path: str) -> None:
    """``{}`` gives the final usage (include_usage defaults to true); false or null gives none;
    ``{}`` without stream is accepted (vLLM refuses only non-empty options)."""
    body = {**BASE[path], "stream": True}
    for fast in (True, False):
        default = _chunks(_post(served, path, {**body, "stream_options": {}}, fast))
        assert default[-1]["choices"] == [] and default[-1]["usage"]["completion_tokens"] > 0
        assert all(c["usage"] is None for c in default[:-1])
        for off in (False, None):
            quiet = {**body, "stream_options": {"include_usage": off}}
            chunks = _chunks(_post(served, path, quiet, fast))
            assert all("usage" not in c or c["usage"] is None for c in chunks)
            assert all(c["choices"] for c in chunks)
        plain = _post(served, path, {**BASE[path], "stream_options": {}}, fast)
        assert plain.status_code == 200, plain.text
        options = {"include_usage": False, "continuous_usage_stats": True}  # not applied: refused
        refused = _post(served, path, {**body, "stream_options": options}, fast)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "stream_options.continuous_usage_stats"


def test_vllm_value_ranges(served: Served) -> None:
    """A negative seed (vLLM takes any int64) repeats itself; a temperature above 2 (vLLM sets
    no upper bound) is served."""
    body = {**BASE[COMPLETIONS], "seed": -7, "temperature": 1.0}
    first, again = (_post(served, COMPLETIONS, body, fast=True) for _ in range(2))
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
    hot = _post(served, COMPLETIONS, {**BASE[COMPLETIONS], "temperature": 3.5}, fast=False)
    assert hot.status_code == 200, hot.text
    too_big = _post(served, COMPLETIONS, {**BASE[COMPLETIONS], "seed": 2**63}, fast=True)
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "seed"
