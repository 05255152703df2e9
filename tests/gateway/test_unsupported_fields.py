"""Fields this server does not serve are a 400 naming the field, on both endpoints and both
lanes (the fast lane takes ``application/json`` bodies; FastAPI's router takes the other JSON
types, e.g. ``application/vnd.api+json``); their null and default forms are served as usual."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import BadRequestError, OpenAI

from gateway.openai_models import ChatCompletionRequest, CompletionRequest
from gateway.unsupported import UNSUPPORTED
from tests.served import Served

MODEL = "stories260K"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
API_JSON = {"content-type": "application/vnd.api+json"}  # JSON, but not for the fast lane
BASE = {
    CHAT: {"messages": [{"role": "user", "content": "Tim"}], "max_tokens": 2, "temperature": 0},
    COMPLETIONS: {"prompt": "Tim", "max_tokens": 2, "temperature": 0},
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BOTH = [
    ("response_format", {"type": "json_object"}),
    ("n", 2),
    ("best_of", 3),
    ("presence_penalty", 0.5),
    ("frequency_penalty", -0.5),
    ("repetition_penalty", 1.2),
    ("logit_bias", {"50256": -100}),
]
CASES = [
    *((CHAT, f, v) for f, v in BOTH),
    (CHAT, "tools", [TOOL]),
    (CHAT, "tool_choice", "required"),
    (CHAT, "tool_choice", {"type": "function", "function": {"name": "f"}}),
    (CHAT, "functions", [TOOL["function"]]),
    (CHAT, "function_call", {"name": "f"}),
    (CHAT, "logprobs", True),
    (CHAT, "top_logprobs", 2),
    *((COMPLETIONS, f, v) for f, v in BOTH),
    (COMPLETIONS, "logprobs", 1),
    (COMPLETIONS, "logprobs", 0),  # still asks for the chosen tokens' log probabilities
    (COMPLETIONS, "echo", True),
    (COMPLETIONS, "suffix", " The end."),
]
DEFAULTS: dict[str, dict[str, Any]] = {
    CHAT: {
        "tools": None,
        "tool_choice": "none",
        "functions": [],
        "function_call": None,
        "response_format": {"type": "text"},
        "logprobs": False,
        "top_logprobs": None,
        "n": 1,
        "best_of": None,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logit_bias": {},
    },
    COMPLETIONS: {
        "response_format": None,
        "logprobs": None,
        "n": 1,
        "best_of": 1,
        "presence_penalty": 0.0,
        "frequency_penalty": None,
        "repetition_penalty": 1,
        "logit_bias": None,
        "echo": False,
        "suffix": None,
    },
}


@pytest.fixture
def client(served: Served) -> OpenAI:
    return OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _post(served: Served, path: str, body: dict[str, Any], fast: bool) -> httpx.Response:
    """Through the fast lane (``application/json``) or FastAPI's route (another JSON type)."""
    url = f"{served.url}{path}"
    if fast:
        return httpx.post(url, json=body, timeout=60)
    return httpx.post(url, content=json.dumps(body).encode(), headers=API_JSON, timeout=60)


def _openai(client: OpenAI, path: str, extra: dict[str, Any]) -> Any:
    base: dict[str, Any] = {k: v for k, v in BASE[path].items() if k != "messages"}
    if path == CHAT:
        messages: Any = BASE[CHAT]["messages"]
        return client.chat.completions.create(
            model=MODEL, messages=messages, extra_body=extra, **base
        )
    return client.completions.create(model=MODEL, extra_body=extra, **base)


def test_every_row_names_a_request_field() -> None:
    known = ChatCompletionRequest.model_fields.keys() | CompletionRequest.model_fields.keys()
    assert set(UNSUPPORTED) <= known
    assert {field for _, field, _ in CASES} == set(UNSUPPORTED)


@pytest.mark.parametrize(("path", "field", "value"), CASES)
def test_unsupported_field_is_a_400_naming_it(
    served: Served, client: OpenAI, path: str, field: str, value: Any
) -> None:
    for fast in (True, False):
        response = _post(served, path, {**BASE[path], field: value}, fast)
        assert response.status_code == 400, (fast, response.text)
        error = response.json()["error"]
        assert error["param"] == field and error["type"] == "invalid_request_error"
        assert f"'{field}' is not supported" in error["message"]
    with pytest.raises(BadRequestError) as rejected:
        _openai(client, path, {field: value})
    assert rejected.value.param == field and f"'{field}'" in rejected.value.message


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_null_and_default_forms_are_served(served: Served, client: OpenAI, path: str) -> None:
    body = {**BASE[path], **DEFAULTS[path]}
    for fast in (True, False):
        response = _post(served, path, body, fast)
        assert response.status_code == 200, (fast, response.text)
        assert response.json()["usage"]["completion_tokens"] == 2
    out = _openai(client, path, DEFAULTS[path])
    assert out.usage is not None and out.usage.completion_tokens == 2


def test_chat_request_fields_of_vllm(served: Served) -> None:
    """chat_template_kwargs and continue_final_message are taken (this model has no template,
    so the kwargs change nothing); continuing needs add_generation_prompt false, as in vLLM."""
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = _post(served, CHAT, BASE[CHAT], fast=True).json()
    for fast in (True, False):
        with_kwargs = _post(served, CHAT, {**BASE[CHAT], **kwargs}, fast)
        assert with_kwargs.json()["choices"] == plain["choices"]
    both = {**BASE[CHAT], "continue_final_message": True}
    for fast in (True, False):
        conflict = _post(served, CHAT, both, fast)
        assert conflict.status_code == 400
        assert conflict.json()["error"]["param"] == "continue_final_message"
    go_on = _post(served, CHAT, {**both, "add_generation_prompt": False}, fast=True)
    assert go_on.status_code == 200, go_on.text
