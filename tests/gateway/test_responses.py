"""The Responses API (``/v1/responses``) with the official openai client: a response and its
continuations serve the same prompt and greedy text as chat completions of the whole
conversation (function calls and their outputs included), streamed events reassemble to the
response, structured outputs validate, stored responses are the caller's alone and expire, and
every field not served is a 400 naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import redis
from openai import BadRequestError, NotFoundError, OpenAI

from shared import streams
from shared.policy import worker_for_key
from tests.served import Served, gateway

MODEL = "stories260K"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: Any = [{"type": "function", "name": "weather", "parameters": WEATHER}]
CHAT_TOOLS: Any = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}]


@pytest.fixture
def client(served: Served) -> OpenAI:
    return OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: OpenAI, messages: Any, **fields: Any) -> Any:
    fields = {"temperature": 0, "max_tokens": 8, **fields}
    return client.chat.completions.create(model=MODEL, messages=messages, **fields)


def test_a_continued_response_is_the_chat_of_the_whole_conversation(client: OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, instructions="Tell a story.", input="Once upon a time",
        temperature=0, max_output_tokens=8,
    )  # fmt: skip
    chat = _chat(client, [{"role": "system", "content": "Tell a story."},
                          {"role": "user", "content": "Once upon a time"}])  # fmt: skip
    assert first.output_text == chat.choices[0].message.content
    assert first.usage is not None and first.usage.input_tokens == chat.usage.prompt_tokens
    assert first.usage.output_tokens == chat.usage.completion_tokens
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    second = client.responses.create(
        model=MODEL, input="Then the cat", previous_response_id=first.id,
        temperature=0, max_output_tokens=8,
    )  # fmt: skip
    history = [  # instructions are not carried over (OpenAI's rule)
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Then the cat"},
    ]
    chat = _chat(client, history)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage is not None and second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_streamed_events_reassemble_to_the_response(client: OpenAI) -> None:
    whole = client.responses.create(
        model=MODEL, input="Lily went", temperature=0, max_output_tokens=12
    )
    events = list(
        client.responses.create(
            model=MODEL, input="Lily went", temperature=0, max_output_tokens=12, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == done.text == final.output_text == whole.output_text
    assert final.usage is not None and final.usage.output_tokens == 12


def test_a_function_call_and_its_output_continue_as_in_chat(client: OpenAI) -> None:
    called = client.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, extra_body={"seed": 3}, max_output_tokens=64,
    )  # fmt: skip
    (call,) = called.output
    assert call.type == "function_call" and call.name == "weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answer = client.responses.create(
        model=MODEL, previous_response_id=called.id, temperature=0, max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id,
         "type": "function", "function": {"name": "weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]  # fmt: skip
    chat = _chat(client, history)
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage is not None and answer.usage.input_tokens == chat.usage.prompt_tokens
    streamed = list(
        client.responses.create(
            model=MODEL, input="Weather in Oslo?", tools=TOOLS, stream=True, extra_body={"seed": 3},
            tool_choice={"type": "function", "name": "weather"}, max_output_tokens=64,
        )
    )  # fmt: skip
    arguments = "".join(
        e.delta for e in streamed if e.type == "response.function_call_arguments.delta"
    )
    (item,) = streamed[-1].response.output  # type: ignore[union-attr]
    assert item.type == "function_call" and item.arguments == arguments
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_a_json_schema_text_format_always_validates(client: OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    for seed in range(5):
        reply = client.responses.create(
            model=MODEL, input="Weather?", text={"format": fmt}, temperature=1.0,
            extra_body={"seed": seed}, max_output_tokens=64,
        )  # fmt: skip
        jsonschema.validate(json.loads(reply.output_text), WEATHER)


def test_logprobs_are_the_chats(client: OpenAI) -> None:
    reply = client.responses.create(
        model=MODEL, input="Lily", temperature=0, max_output_tokens=4,
        include=["message.output_text.logprobs"], top_logprobs=2,
    )  # fmt: skip
    chat = _chat(client, [{"role": "user", "content": "Lily"}], max_tokens=4,
                 logprobs=True, top_logprobs=2)  # fmt: skip
    ours = reply.output[0].content[0].logprobs  # type: ignore[union-attr]
    theirs = chat.choices[0].logprobs.content
    assert [p.token for p in ours] == [p.token for p in theirs]
    # the same up to the rounding of another batch's (or the prefix cache's) arithmetic
    assert [p.logprob for p in ours] == pytest.approx([p.logprob for p in theirs], abs=1e-4)
    assert [len(p.top_logprobs) for p in ours] == [2] * 4


def test_replayed_output_items_are_taken_as_the_sdk_sends_them(client: OpenAI) -> None:
    """The Agents SDK replays a response's output items as input (ids, status, annotations,
    logprobs): served as the conversation they hold."""
    first = client.responses.create(model=MODEL, input="Lily", temperature=0, max_output_tokens=4)
    replayed = [{"role": "user", "content": "Lily"}, *[o.model_dump() for o in first.output],
                {"role": "user", "content": "Then"}]  # fmt: skip
    chained = client.responses.create(
        model=MODEL, input="Then", previous_response_id=first.id, temperature=0,
        max_output_tokens=4,
    )  # fmt: skip
    sent = client.responses.create(model=MODEL, input=replayed, temperature=0, max_output_tokens=4)
    assert sent.output_text == chained.output_text
    assert sent.usage is not None and chained.usage is not None
    assert sent.usage.input_tokens == chained.usage.input_tokens


def test_stored_responses_are_the_callers_and_expire(served: Served, client: OpenAI) -> None:
    admin = httpx.Client(base_url=served.url, headers=served.admin_headers, timeout=30)
    created = admin.post("/admin/v1/api-keys", json={"tenant": "resp"}).json()
    try:
        owner = OpenAI(base_url=f"{served.url}/v1", api_key=created["api_key"], max_retries=0)
        reply = owner.responses.create(model=MODEL, input="Lily", max_output_tokens=2)
        assert owner.responses.retrieve(reply.id).id == reply.id
        with pytest.raises(NotFoundError):
            client.responses.retrieve(reply.id)  # another caller: as if it never was
        with pytest.raises(NotFoundError):
            client.responses.create(model=MODEL, input="x", previous_response_id=reply.id)
        ttl_ms = redis.Redis.from_url(served.redis_url).pttl(streams.response_key(reply.id))
        assert 0 < ttl_ms <= 3600 * 1000
        owner.responses.delete(reply.id)
        with pytest.raises(NotFoundError):
            owner.responses.retrieve(reply.id)
    finally:
        admin.delete(f"/admin/v1/api-keys/{created['key_id']}")
    unstored = client.responses.create(model=MODEL, input="Lily", max_output_tokens=2, store=False)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["file_search_call.results"]}, "include.0"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools.0.parameters"),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function"}},
         "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "objectx"},
                              "name": "x"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"text": {"format": {"type": "json_object", "schema": {}}}}, "text.format.schema"),
        ({"text": {"format": {"type": "text", "name": "x"}}}, "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {},
                              "unknown": 1}}}, "text.format.unknown"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input.0.content.0.type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"max_output_token": 5}, "max_output_token"),
        ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input.0.name"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x",
                                                   "cache": 1}]}]}, "input.0.content.0.cache"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_400_naming_it(
    client: OpenAI, fields: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "Lily", **fields}
    with pytest.raises(BadRequestError) as refused:
        client.post("/responses", body=body, cast_to=httpx.Response)
    error = refused.value.body
    assert isinstance(error, dict) and error.get("param") == param, error


def test_a_conversation_lives_as_long_as_its_newest_turn(served: Served, client: OpenAI) -> None:
    """Each response kept its own TTL: a conversation used a minute ago broke once its first
    turn (an hour old) expired. A continuation now renews its whole chain."""
    store = redis.Redis.from_url(served.redis_url)
    first = client.responses.create(model=MODEL, input="Lily", max_output_tokens=2)
    assert first.id.startswith("resp_")
    store.pexpire(streams.response_key(first.id), 5_000)  # about to expire
    second = client.responses.create(
        model=MODEL, input="Then", previous_response_id=first.id, max_output_tokens=2
    )
    assert store.pttl(streams.response_key(first.id)) > 3_000_000  # renewed with the chain
    assert second.usage is not None and first.usage is not None
    assert first.usage.input_tokens_details.cached_tokens < first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt
    record = json.loads(store.get(streams.response_key(second.id)) or b"{}")
    assert record["worker"] and record["previous"] == first.id  # the next turn's worker
    client.responses.delete(first.id)
    with pytest.raises(NotFoundError) as missing:
        client.responses.create(
            model=MODEL, input="x", previous_response_id=second.id, max_output_tokens=2
        )
    assert "an earlier turn" in str(missing.value)


def test_a_third_turn_carries_both_earlier_ones(served: Served, client: OpenAI) -> None:
    """Each record names the chain it continues; one stored before records did (no
    ``chain``) is walked through ``previous``: the same prompt either way."""
    turns = ["Lily", "Then", "And"]
    previous: Any = None
    history: list[dict[str, str]] = []
    for text in turns:
        previous = client.responses.create(
            model=MODEL, input=text, previous_response_id=previous and previous.id,
            temperature=0, max_output_tokens=3,
        )  # fmt: skip
        history += [{"role": "user", "content": text},
                    {"role": "assistant", "content": previous.output_text}]  # fmt: skip
    next_turn = [*history, {"role": "user", "content": "So"}]
    expected = _chat(client, next_turn).usage.prompt_tokens
    store = redis.Redis.from_url(served.redis_url)
    key = streams.response_key(previous.id)
    for strip in (False, True):
        if strip:  # as stored before records named their chain
            record = json.loads(store.get(key) or b"{}")
            del record["chain"]
            store.set(key, json.dumps(record), keepttl=True)
        last = client.responses.create(
            model=MODEL, input="So", previous_response_id=previous.id, max_output_tokens=1
        )
        assert last.usage is not None and last.usage.input_tokens == expected, strip


def test_the_stream_ends_as_openais_and_done_carries_the_logprobs(served: Served) -> None:
    body = {
        "model": MODEL, "input": "Lily", "max_output_tokens": 3, "stream": True,
        "include": ["message.output_text.logprobs"], "temperature": 0,
    }  # fmt: skip
    with httpx.stream("POST", f"{served.url}/v1/responses", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in lines[-1]  # OpenAI's Responses streams end with their last event
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    deltas = [p for e in events if e["type"] == "response.output_text.delta" for p in e["logprobs"]]
    assert done["logprobs"] == deltas and len(deltas) == 3


@pytest.fixture(scope="module")
def impatient_gateway(served: Served, stories_path: Path) -> Iterator[str]:
    """A gateway whose tokens time out at once: every stream fails after it started."""
    env = {"SUPERINFER_FIRST_TOKEN_TIMEOUT_S": "0.001", "SUPERINFER_TOKEN_TIMEOUT_S": "0.001"}
    with gateway(served.redis_url, str(stories_path), env) as url:
        yield url


def test_a_stream_that_fails_ends_with_response_failed(impatient_gateway: str) -> None:
    """It ended with a bare error event: the client's responses.stream() raised "Didn't
    receive a response.completed event", and nothing was stored."""
    client = OpenAI(base_url=f"{impatient_gateway}/v1", api_key="unused", max_retries=0)
    events = list(
        client.responses.create(model=MODEL, input="Lily", max_output_tokens=400, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"]
    failed = events[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.code == "server_error"  # one of OpenAI's codes; ours is in the event
    assert failed.id in events[-2].message  # type: ignore[union-attr]
    assert client.responses.retrieve(failed.id).status == "failed"


def test_prompt_cache_key_picks_one_worker_in_every_gateway(client: OpenAI) -> None:
    workers = [f"w{i}" for i in range(8)]
    keys = [f"user-{i}" for i in range(400)]
    picked = {key: worker_for_key(key, workers) for key in keys}
    assert picked == {key: worker_for_key(key, list(reversed(workers))) for key in keys}
    assert len(set(picked.values())) == 8  # spread over every worker
    without_w3 = {key: worker_for_key(key, [w for w in workers if w != "w3"]) for key in keys}
    moved = [key for key in keys if without_w3[key] != picked[key]]
    assert moved and all(picked[key] == "w3" for key in moved)  # only w3's keys move
    assert worker_for_key("k", []) is None
    client.responses.create(model=MODEL, input="Lily", max_output_tokens=2, prompt_cache_key="u")
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Lily"}], max_tokens=2,
        prompt_cache_key="u",
    )  # fmt: skip
