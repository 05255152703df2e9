"""The 400 for a request past the model's context states the prompt's length, the limit and
max_tokens (given or not), never "asks for 0 more" or "-1 more" (issue 30 item 7); its param
is the prompt when the prompt fills the context alone, else max_tokens."""

from __future__ import annotations

import re

import httpx

from tests.served import Served


def _overflow(served: Served, path: str, body: dict[str, object], param: str) -> str:
    response = httpx.post(f"{served.url}/v1/{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param
    return str(error["message"])


def _max_model_len(served: Served) -> int:
    models = httpx.get(f"{served.url}/v1/models", timeout=30).json()["data"]
    return int(models[0]["max_model_len"])


def test_overflow_without_max_tokens_states_prompt_and_limit(served: Served) -> None:
    """A chat request without max_tokens gets the rest of the context, here none at all."""
    limit = _max_model_len(served)
    messages = [{"role": "user", "content": "Once upon a time " * limit}]
    message = _overflow(served, "chat/completions", {"messages": messages}, "messages")
    found = re.search(r"the prompt has (\d+) tokens", message)
    assert found is not None and int(found.group(1)) >= limit, message
    assert f"maximum context length of {limit} tokens" in message, message
    assert "max_tokens not given" in message and "more" not in message, message


def test_overflow_with_max_tokens_states_all_three(served: Served) -> None:
    limit = _max_model_len(served)
    for num_prompt, max_tokens in ((5, limit), (limit, None)):  # None: completions' 16
        body: dict[str, object] = {"prompt": [1] * num_prompt}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        param = "prompt" if num_prompt >= limit else "max_tokens"
        message = _overflow(served, "completions", body, param)
        asked = max_tokens or 16
        assert f"the prompt has {num_prompt} tokens and max_tokens is {asked}" in message
        limit_text = f"maximum context length of {limit} tokens"
        assert f"{num_prompt + asked} in all, over this model's {limit_text}" in message
