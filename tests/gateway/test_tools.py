"""Tool calling: ``tool_choice`` required and a named function enforced by structured outputs
(the arguments always parse and match the tool's schema, checked with jsonschema), streamed
calls reassembling to the non-streamed call, tool messages and assistant calls in a history,
``auto`` with the hermes parser (vLLM's flags), and the parsers and the stream's hold-back on
model outputs written here."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from gateway.errors import APIError
from gateway.openai_models import ChatCompletionRequest
from gateway.tool_parsers import parse_calls
from gateway.tools import ToolPlan, ToolStream, plan_tools, split_output
from tests.served import Served

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
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock", "description": "now", "parameters": TIME}},
]
SCHEMAS = {"weather": WEATHER, "clock": TIME}
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture
def client(served: Served) -> OpenAI:
    return OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(call: Any) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_calls_parse_and_match_their_schema(client: OpenAI) -> None:
    required = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=8,
        temperature=1.0, seed=4, max_tokens=64, parallel_tool_calls=False,
    )  # fmt: skip
    names = set()
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        assert len(calls) == 1  # parallel_tool_calls false
        _check_call(calls[0])
        names.add(calls[0].function.name)
    named = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64, temperature=1.0, seed=5,
        tool_choice={"type": "function", "function": {"name": "clock"}},
    )  # fmt: skip
    (call,) = named.choices[0].message.tool_calls or []
    assert call.function.name == "clock"
    _check_call(call)


def test_a_streamed_call_reassembles_to_the_same_call(client: OpenAI) -> None:
    common: Any = dict(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0,
        seed=9, max_tokens=64, parallel_tool_calls=False,
    )  # fmt: skip
    whole = client.chat.completions.create(**common)
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in client.chat.completions.create(**common, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function and delta.function.name:
                    call["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    expected = whole.choices[0].message.tool_calls or []
    assert len(expected) == 1
    assert [c["name"] for c in calls.values()] == [c.function.name for c in expected]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [
        json.loads(c.function.arguments) for c in expected
    ]
    assert reasons[-1] == "tool_calls"


def test_a_history_with_calls_and_tool_answers_is_rendered(served: Served) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    body = {"model": MODEL, "messages": history, "tool_choice": "none", "max_tokens": 4}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    tokenized = httpx.post(
        f"{served.url}/tokenize", json={"messages": history, "return_token_strs": False}
    ).json()
    plain = httpx.post(f"{served.url}/tokenize", json={"messages": history[-1:]}).json()
    assert tokenized["count"] > plain["count"]  # the calls and the answer are in the prompt
    bad = [*history[:1], {**history[1], "tool_calls": [{"id": "x", "function": {"name": 3}}]}]
    refused = httpx.post(f"{served.url}/v1/chat/completions", json={**body, "messages": bad})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages.1"
    call, url = history[1]["tool_calls"][0], f"{served.url}/v1/chat/completions"
    as_streamed = {**call, "index": 0, "function": {**call["function"], "parsed_arguments": {}}}
    echoed = [*history[:1], {**history[1], "tool_calls": [as_streamed]}, history[2]]
    again = httpx.post(f"{served.url}/v1/chat/completions", json={**body, "messages": echoed})
    assert again.status_code == 200, again.text  # the openai client's own output fields
    for where, extra in (("", {"extra": 1}), (".function", {"strict": True})):
        function = {**call["function"], **(extra if where else {})}
        odd = {**call, **({} if where else extra), "function": function}
        messages = [*history[:1], {**history[1], "tool_calls": [odd]}, history[2]]
        refused = httpx.post(url, json={**body, "messages": messages})
        param = f"messages.1.tool_calls.0{where}.{next(iter(extra))}"
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    for role, field in (("user", {"tool_call_id": "call_1"}), ("tool", {"tool_calls": [call]})):
        messages = [{"role": role, "content": "x", **field}]
        refused = httpx.post(url, json={**body, "messages": messages})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == f"messages.0.{next(iter(field))}"


def test_tool_choice_none_still_renders_the_tools(served: Served, client: OpenAI) -> None:
    """vLLM's default: the prompt defines the functions a history's calls name (the tools were
    left out, so a model saw calls to functions it was never given)."""
    small: Any = [{"type": "function", "function": {"name": "clock"}}]
    common: Any = dict(model=MODEL, messages=MESSAGES, max_tokens=1)
    with_tools = client.chat.completions.create(**common, tools=small, tool_choice="none")
    without = client.chat.completions.create(**common)
    assert with_tools.usage is not None and without.usage is not None
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens
    body = ChatCompletionRequest.model_validate({**common, "tools": small, "tool_choice": "none"})
    assert plan_tools(body, False, None).render
    assert not plan_tools(body, False, None, exclude_tools_when_none=True).render


def test_auto_needs_the_servers_flags_and_then_parses(
    served: Served, client: OpenAI, tuned_gateway: str
) -> None:
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=4)
    assert refused.value.param == "tool_choice" and "--enable-auto-tool-choice" in str(
        refused.value
    )
    tuned = OpenAI(base_url=f"{tuned_gateway}/v1", api_key="unused", max_retries=0)
    out = tuned.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0.0
    )
    assert out.choices[0].message.content  # this model writes text, not calls
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("choice", "param"),
    [
        ({"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ("sometimes", "tool_choice"),
    ],
)
def test_bad_tool_choices_are_400s(served: Served, choice: Any, param: str) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    bad_tool = {**body, "tool_choice": "required", "tools": [{"type": "function"}]}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=bad_tool, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools.0"
    extra = {"name": "f", "parameters": {}, "bogus": 1}
    bad_tool["tools"] = [{"type": "function", "function": extra}]
    response = httpx.post(f"{served.url}/v1/chat/completions", json=bad_tool, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools.0.function.bogus"


# ---- the parsers and the stream, on outputs written here ------------------------------------


def test_hermes_and_llama3_outputs_parse() -> None:
    text = (
        'Let me check. <tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}'
        '\n</tool_call>\n<tool_call>{"name": "clock", "arguments": {"zone": "UTC"}}</tool_call>'
    )
    content, calls = parse_calls("hermes", text)
    assert content == "Let me check. "  # as generated (vLLM's; the stream sent the space too)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo", "days": 2}),
        ("clock", {"zone": "UTC"}),
    ]
    assert parse_calls("hermes", "no calls here") == ("no calls here", [])
    assert parse_calls("hermes", "<tool_call>{not json</tool_call>")[1] == []
    content, calls = parse_calls(
        "llama3_json", '{"name": "clock", "parameters": {"zone": "CET"}}; {"name": "weather", '
        '"parameters": {"city": "Lima", "days": 1}}'
    )  # fmt: skip
    assert content == "" and [c.name for c in calls] == ["clock", "weather"]
    assert parse_calls("llama3_json", "Hello {x}")[1] == []
    # a ";" inside an argument is the argument's (the call was lost as content); non-ASCII kept
    (call,) = parse_calls("llama3_json", '{"name": "q", "parameters": {"sql": "a;b", "c": "São"}}')[
        1
    ]
    assert json.loads(call.arguments) == {"sql": "a;b", "c": "São"} and "São" in call.arguments
    assert parse_calls("llama3_json", '{"name": "q", "parameters": {}} trailing')[1] == []


def test_parallel_tool_calls_false_keeps_the_first_auto_call() -> None:
    call = '<tool_call>{{"name": "{}", "arguments": {{}}}}</tool_call>'
    text = call.format("a") + call.format("b")
    one = ToolPlan("auto", render=True, parser="hermes", parallel=False)
    assert [c.name for c in split_output(one, text, "stop")[1]] == ["a"]
    stream = ToolStream(one)
    stream.feed(text)
    assert [c.name for c in stream.finish("stop")[1]] == ["a"]
    both = ToolPlan("auto", render=True, parser="hermes")
    assert [c.name for c in split_output(both, text, "stop")[1]] == ["a", "b"]


def test_required_calls_resolve_each_tools_defs(client: OpenAI) -> None:
    """``openai.pydantic_function_tool`` of a nested model writes ``$defs`` and ``$ref``: under
    required they were nested in the array's schema, where ``#/$defs/...`` did not resolve (a
    400 from the grammar compiler)."""
    address = {"type": "object", "properties": {"city": {"enum": ["Oslo"]}},
               "required": ["city"], "additionalProperties": False}  # fmt: skip
    ship = {
        "type": "object", "$defs": {"Address": address},
        "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"],
        "additionalProperties": False,
    }  # fmt: skip
    tools: Any = [{"type": "function", "function": {"name": "ship", "parameters": ship}}]
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required", max_tokens=190,
        temperature=1.0, seed=1, parallel_tool_calls=False,
    )  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls or []
    jsonschema.validate(json.loads(call.function.arguments), ship)
    named = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=tools, max_tokens=190, temperature=1.0, seed=1,
        tool_choice={"type": "function", "function": {"name": "ship"}},
    )  # fmt: skip
    assert named.choices[0].finish_reason == "stop"  # OpenAI's and vLLM's for a named call


def test_the_stream_holds_back_only_what_may_be_a_call() -> None:
    plan = ToolPlan("auto", render=True, parser="hermes")
    stream = ToolStream(plan)
    pieces = [
        "Sure",
        ", one moment <to",
        "ol_call>",
        '{"name": "clock", "arguments": {}}',
        "</tool_call>",
    ]
    released = "".join(stream.feed(piece) for piece in pieces)
    assert released == "Sure, one moment "
    rest, calls = stream.finish("stop")
    assert rest == "" and [c.name for c in calls] == ["clock"]
    plain = ToolStream(plan)
    assert plain.feed("A <t") == "A "  # may begin a tag: held
    assert plain.feed("able>") == "<table>"
    assert plain.finish("stop") == ("", [])


def test_plans() -> None:
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS})
    with pytest.raises(APIError):
        plan_tools(body, auto_enabled=False, parser=None)
    assert plan_tools(body, True, "hermes").mode == "auto"
    none = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tool_choice": "none"})
    assert not plan_tools(none, False, None).calls_tools


def test_required_lifts_defs_and_definitions_under_their_own_keys() -> None:
    """``#/definitions/A`` pointed nowhere once every tool's defs went under ``$defs`` (a 400
    from the grammar compiler)."""
    from shared.grammar import grammar_problem

    inner = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    for key in ("$defs", "definitions"):
        params = {"type": "object", key: {"A": inner}, "required": ["a"],
                  "properties": {"a": {"$ref": f"#/{key}/A"}}}  # fmt: skip
        tools: Any = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        body = ChatCompletionRequest.model_validate(
            {"messages": MESSAGES, "tools": tools, "tool_choice": "required"}
        )
        plan = plan_tools(body, False, None)
        assert plan.structured is not None and grammar_problem(plan.structured) is None, key
        assert json.loads(plan.structured.spec)[key] == {"A": inner}


def test_an_enforced_output_cut_by_max_tokens_is_calls_never_content(client: OpenAI) -> None:
    """The enforcing JSON came out as the message's content (and streamed as content deltas);
    now the calls as far as they came, finish reason length, as OpenAI returns a cut call."""
    required = ToolPlan("required")
    cut = '[{"name": "weather", "parameters": {"city": "Oslo", "days": 2}}, {"name": "clock", '
    cut += '"parameters": {"zo'
    content, calls = split_output(required, cut, "length")
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("weather", '{"city": "Oslo", "days": 2}'),
        ("clock", '{"zo'),
    ]
    assert split_output(required, '[{"name": "wea', "length") == ("", [])
    named = ToolPlan("named", named="clock")
    assert [(c.name, c.arguments) for c in split_output(named, '{"zo', "length")[1]] == [
        ("clock", '{"zo')
    ]
    for stream in (False, True):
        response = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=2,
            max_tokens=6, temperature=1.0, seed=3, stream=stream,
        )  # fmt: skip
        chunks = list(response) if stream else [response]
        for chunk in chunks:
            for choice in chunk.choices:
                part = choice.delta if stream else choice.message
                assert not part.content, part.content
                if choice.finish_reason is not None:
                    assert choice.finish_reason == "length"
