"""Structured outputs through the whole system (stories260K behind ``serve``, which knows no
JSON): 50 samples at temperature 1 for each of three schemas (nested object, enum, array) all
parse and validate with jsonschema (an independent validator); vLLM's guided_choice / regex /
grammar and ``structured_outputs`` hold too, streamed as well; what cannot compile is a 400."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.served import Served

MODEL = "stories260K"
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "home": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Oslo", "Lima", "Pune"]},
                    "zip": {"type": "string", "pattern": "^[0-9]{4}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "home"],
        "additionalProperties": False,
    },
    "enum": {"enum": ["red", "green", "blue", 7, None]},
    "array": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
}


@pytest.fixture
def client(served: Served) -> OpenAI:
    return OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_fifty_samples_of_each_schema_validate(client: OpenAI, name: str) -> None:
    schema = SCHEMAS[name]
    response_format: Any = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me"}], n=50, temperature=1.0,
        max_tokens=96, seed=1, response_format=response_format,
    )  # fmt: skip
    assert len(out.choices) == 50
    values = []
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content  # complete, not cut
        value = json.loads(choice.message.content or "")
        jsonschema.validate(value, schema)
        values.append(json.dumps(value))
    assert len(set(values)) > 1  # sampled, not one forced answer


def test_vllm_fields_and_streaming(served: Served, client: OpenAI) -> None:
    prompt = "Once upon a time"
    choice = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=2,
        extra_body={"guided_choice": ["yes", "no", "maybe so"]},
    )  # fmt: skip
    assert choice.choices[0].text in {"yes", "no", "maybe so"}
    regex = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=3,
        extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{2,5} [0-9]{2}"}},
    )  # fmt: skip
    assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", regex.choices[0].text)
    grammar = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=4,
        extra_body={"guided_grammar": 'root ::= "Tim" | "Tim and " name\nname ::= "Sue" | "Max"'},
    )  # fmt: skip
    assert re.fullmatch(r"Tim( and (Sue|Max))?", grammar.choices[0].text)
    text, schema = "", SCHEMAS["nested"]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Go"}], temperature=1.0, seed=5,
        max_tokens=96, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    jsonschema.validate(json.loads(text), schema)
    unbounded = client.chat.completions.create(  # any JSON object (strings of any length)
        model=MODEL, messages=[{"role": "user", "content": "Go"}], temperature=0.0,
        max_tokens=200, response_format={"type": "json_object"},
    )  # fmt: skip
    if unbounded.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(unbounded.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert (unbounded.choices[0].message.content or "").startswith("{")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "([a-z"}, "guided_regex"),  # does not compile
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
         "response_format.json_schema"),
        ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}},
         "response_format.json_schema"),
        ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}},
         "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
         "structured_outputs.disable_any_whitespace"),
        ({"structured_outputs": {"grammar": "root ::= root root"}},  # matches nothing
         "structured_outputs"),
        ({"guided_grammar": "root ::= root root"}, "guided_grammar"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_a_400(served: Served, extra: dict[str, Any], param: Any) -> None:
    body = {"model": MODEL, "prompt": "Tim", "max_tokens": 4, **extra}
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param


def test_vllms_options_true_of_every_output_are_served(served: Served) -> None:
    """vLLM's structured_outputs options that hold here anyway (JSON without free whitespace,
    one backend) are accepted, not refused as unknown keys."""
    options = {"disable_any_whitespace": True, "disable_fallback": True, "whitespace_pattern": None}
    body = {"model": MODEL, "prompt": "Tim", "max_tokens": 6, "temperature": 0}
    body["structured_outputs"] = {"regex": "[a-z]{3}", **options}
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert re.fullmatch("[a-z]{3}", response.json()["choices"][0]["text"])


def test_the_openai_client_sees_a_bad_schema_as_a_bad_request(client: OpenAI) -> None:
    bad: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Go"}], max_tokens=4,
            response_format=bad,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"guided_json": {"$ref": "#/$defs/Missing"}}, "guided_json"),
        ({"structured_outputs": {"regex": "(x"}}, "structured_outputs"),
    ],
)
def test_a_stream_whose_grammar_does_not_compile_is_a_400_before_it_starts(
    client: OpenAI, extra: dict[str, Any], param: str
) -> None:
    """It was a 200, then an error event (the worker found it): the openai client's create()
    succeeded and its iteration raised a generic APIError; the message carried xgrammar's
    timestamp and source path."""
    for n in (1, 2):
        with pytest.raises(BadRequestError) as refused:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Go"}], max_tokens=4,
                stream=True, n=n, extra_body=extra,
            )  # fmt: skip
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == param
        assert ".cc:" not in error["message"] and not error["message"].startswith("[")


def test_min_tokens_does_not_carry_an_output_past_its_grammars_end(client: OpenAI) -> None:
    """With both masks every logit was -inf once the choice was complete, and the sampler drew
    tokens the grammar refused ("yesectableectable...", finish "stop")."""
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Go"}], max_tokens=16, n=2,
            temperature=temperature, seed=3, extra_body={"guided_choice": ["yes", "no"],
                                                         "min_tokens": 5},
        )  # fmt: skip
        for choice in reply.choices:
            assert choice.message.content in ("yes", "no") and choice.finish_reason == "stop"


def test_a_large_structured_output_is_served_and_an_oversized_one_is_a_400(
    client: OpenAI,
) -> None:
    """5,000 choices (~100 KB, inside the body limit) were over the worker's 64 KiB bound on
    one string: it dropped the request and the client waited 60 s for a 504. One whose JSON is
    over the worker's bound (non-ASCII text escaped) is a 400 naming the field."""
    options = [f"option number {i}" for i in range(5000)]
    picked = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "pick"}], max_tokens=40,
        temperature=0, extra_body={"guided_choice": options}, timeout=30,
    )  # fmt: skip
    assert picked.choices[0].message.content in options
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "pick"}], max_tokens=4,
            stream=True, extra_body={"guided_choice": ["é" * 1000] * 190},
        )  # fmt: skip
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "guided_choice"
