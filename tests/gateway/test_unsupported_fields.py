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
from tests.conftest import STORIES_REFERENCE_TOKENS
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
    ("best_of", 3),
    ("skip_special_tokens", False),
    ("store", True),
    ("metadata", {"team": "a"}),
    ("service_tier", "flex"),
]
CASES = [
    *((CHAT, f, v) for f, v in BOTH),
    (CHAT, "functions", [TOOL["function"]]),
    (CHAT, "function_call", {"name": "f"}),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "prediction", {"type": "content", "content": "Tim"}),
    (CHAT, "reasoning_effort", "low"),
    (CHAT, "web_search_options", {"search_context_size": "low"}),
    *((COMPLETIONS, f, v) for f, v in BOTH),
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
        "skip_special_tokens": True,
        "store": False,
        "service_tier": "auto",
        "modalities": ["text"],
        "parallel_tool_calls": None,
        "guided_json": None,
        "stream": None,  # OpenAI's schema allows null: not streamed
    },
    COMPLETIONS: {
        "stream": None,
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
        "spaces_between_special_tokens": False,
        "metadata": {},
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


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),  # no stream
        (
            COMPLETIONS,
            {"stream": False, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (COMPLETIONS, {"stop": ""}, "stop"),
        (CHAT, {"stop": ["\n", ""]}, "stop"),
    ],
)
def test_combinations_vllm_refuses_are_a_400(
    served: Served, path: str, body: dict[str, Any], param: str
) -> None:
    """vLLM's answers: stream_options only with stream; an empty stop string would stop
    nothing (it was silently dropped)."""
    for fast in (True, False):
        response = _post(served, path, {**BASE[path], **body}, fast)
        assert response.status_code == 400, (fast, response.text)
        assert response.json()["error"]["param"] == param


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


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {"max_token": 5}, "max_token"),  # a typo of max_tokens
        (CHAT, {"reponse_format": {"type": "json_object"}}, "reponse_format"),
        (CHAT, {"stream_options": {"include_usage": True, "usage": 1}}, "stream_options.usage"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "Tim", "weight": 2}]},
            "messages.0.weight",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
            "messages.0.content.0.x",
        ),
        (CHAT, {"response_format": {"type": "json_object", "x": 1}}, "response_format.x"),
    ],
)
def test_an_unknown_field_is_a_400_naming_it(
    served: Served, path: str, body: dict[str, Any], param: str
) -> None:
    """Not served as if it were not there: a typo or a feature this server lacks."""
    for fast in (True, False):
        response = _post(served, path, {**BASE[path], **body}, fast)
        assert response.status_code == 400, (fast, response.text)
        error = response.json()["error"]
        assert error["param"] == param and f"'{param}'" in error["message"]


def test_vllm_sampling_fields_are_applied(served: Served, client: OpenAI) -> None:
    """Through the official client's extra_body, greedy from "Once upon a time": stop_token_ids
    ends at the reference's token (stories260K's tokens, tests/conftest.py), min_tokens holds it
    back, include_stop_str_in_output keeps the stop string, min_p 1 is greedy at temperature 2."""
    ref = STORIES_REFERENCE_TOKENS  # greedy from BOS: "Once upon a time, there was a little..."
    prompt = [1, *ref[:4]]
    base: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    free = client.completions.create(**base)
    stop_id = ref[6]
    stopped = client.completions.create(**base, extra_body={"stop_token_ids": [stop_id]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage is not None
    assert stopped.usage.completion_tokens == 3  # ref[4], ref[5], then the stop token ref[6]
    # the stop token ends the text without its own text (vLLM), unless asked to keep it
    with_stop = client.completions.create(
        **base, extra_body={"stop_token_ids": [stop_id], "include_stop_str_in_output": True}
    )
    assert stopped.choices[0].text == free.choices[0].text[: len(stopped.choices[0].text)]
    assert with_stop.choices[0].text.startswith(stopped.choices[0].text)
    assert len(with_stop.choices[0].text) > len(stopped.choices[0].text)
    assert free.choices[0].text.startswith(with_stop.choices[0].text)
    held = client.completions.create(
        **base, extra_body={"stop_token_ids": [stop_id], "min_tokens": 8}
    )
    assert held.usage is not None and held.usage.completion_tokens >= 8
    assert held.choices[0].text != free.choices[0].text  # the stop token was never drawn
    kept = client.completions.create(
        **base, stop=[" was"], extra_body={"include_stop_str_in_output": True}
    )
    cut = client.completions.create(**base, stop=[" was"])
    assert kept.choices[0].text == cut.choices[0].text + " was"
    # vLLM's stop_reason: what ended it (None for a length or EOS)
    reasons = [c.choices[0].model_extra["stop_reason"] for c in (cut, stopped, free)]
    assert reasons == [" was", stop_id, None]
    forced = client.completions.create(**base, logit_bias={str(ref[0]): 100})
    assert forced.choices[0].text == " Once" * 12  # the biased token, 12 times
    for bad in ({"x": 1}, {"5": 101}, {"5": True}):
        with pytest.raises(BadRequestError) as refused:
            client.completions.create(**base, logit_bias=bad)  # type: ignore[arg-type]
        assert refused.value.param == "logit_bias"
    longer = {**base, "max_tokens": 48}  # long enough for greedy to repeat a token
    plain = client.completions.create(**longer).choices[0].text
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalized = client.completions.create(**longer, **penalty).choices[0].text  # type: ignore[arg-type]
        assert penalized != plain, penalty
    repeated = client.completions.create(**longer, extra_body={"repetition_penalty": 2.0})
    assert repeated.choices[0].text != plain
    hot = {**base, "temperature": 2.0}
    for seed in range(4):
        greedy = client.completions.create(**hot, seed=seed, extra_body={"min_p": 1.0})
        assert greedy.choices[0].text == free.choices[0].text
