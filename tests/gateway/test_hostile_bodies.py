"""Hostile bodies through both lanes (the fast lane takes ``application/json``; FastAPI's router
the other JSON types, here ``application/vnd.api+json``): the same status and the same
OpenAI-shaped error on both, never a 5xx, and nothing of an exception's internals in the body.

The rules: a body that does not parse (nested deeper than the parser goes, not UTF-8, a
5000-digit integer) is a 400; a lone surrogate in any text field is a 400 naming the field; a
UTF-8 BOM before the JSON is accepted (json.loads takes it, on both lanes); numbers out of range
(1e999, 10**400, NaN) are a 400 naming the field; a 1 MB string is judged like any other."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from tests.served import Served

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LANES = {"fast": "application/json", "fastapi": "application/vnd.api+json"}
INTERNALS = re.compile(r"Traceback|\w+(Error|Exception)\b|File \"|line \d+|0x[0-9a-f]{6,}")


def _chat(content: Any, **extra: Any) -> bytes:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1, **extra}
    return json.dumps(body).encode()


def _prompt(prompt: Any = "Once", **extra: Any) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}).encode()


def _plus(body: bytes, raw_field: bytes) -> bytes:
    """``body`` with one more field written raw (what json.dumps would never write)."""
    return body[:-1] + b", " + raw_field + b"}"


DEEP = 10_000
MEGA = "x" * 1_000_000
NESTED = b'"chat_template_kwargs": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP
BIG = b"1" + b"0" * 400  # 10**400
CORPUS: list[tuple[str, str, bytes, int]] = [  # (name, path, raw body, expected status)
    ("deep-array", COMPLETIONS, b"[" * DEEP + b"]" * DEEP, 400),
    ("deep-prompt", COMPLETIONS, b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400),
    ("deep-kwargs", CHAT, _plus(_chat("hi"), NESTED), 400),
    ("surrogate-prompt", COMPLETIONS, b'{"prompt": "a\\ud800b", "max_tokens": 1}', 400),
    ("surrogate-prompt-list", COMPLETIONS, b'{"prompt": ["\\udfff"], "max_tokens": 1}', 400),
    ("surrogate-content", CHAT, _chat("a").replace(b'"a"', b'"a\\ud800"'), 400),
    ("surrogate-part", CHAT, _chat([{"type": "text", "text": "@"}]).replace(b"@", b"\\udc00"), 400),
    ("surrogate-name", CHAT, _chat("hi").replace(b'"hi"', b'"hi", "name": "\\ud800"'), 400),
    ("surrogate-user", CHAT, _plus(_chat("hi"), b'"user": "\\ud800"'), 400),
    ("surrogate-stop", COMPLETIONS, _plus(_prompt(), b'"stop": ["\\ud800"]'), 400),
    ("surrogate-kwargs", CHAT, _plus(_chat("hi"), b'"chat_template_kwargs": {"\\ud800": 1}'), 400),
    ("surrogate-model", COMPLETIONS, _plus(_prompt(), b'"model": "\\ud800"'), 400),
    ("surrogate-regex", CHAT, _plus(_chat("hi"), b'"guided_regex": "a\\ud800"'), 400),
    (
        "surrogate-grammar",
        COMPLETIONS,
        _plus(_prompt(), b'"guided_grammar": "r ::= \\"\\ud800\\""'),
        400,
    ),
    (
        "surrogate-structured",
        CHAT,
        _plus(_chat("hi"), b'"structured_outputs": {"regex": "a\\ud800"}, "stream": true'),
        400,
    ),
    ("surrogate-pair-ok", COMPLETIONS, _prompt().replace(b"Once", b"\\ud83d\\ude00"), 200),
    ("utf8-surrogate-bytes", COMPLETIONS, _prompt().replace(b"Once", b"a\xed\xa0\x80b"), 400),
    ("latin-1", COMPLETIONS, _prompt().replace(b"Once", b"caf\xe9"), 400),
    ("bom", COMPLETIONS, b"\xef\xbb\xbf" + _prompt(), 200),
    ("bom-twice", COMPLETIONS, b"\xef\xbb\xbf\xef\xbb\xbf" + _prompt(), 400),
    ("max-tokens-1e999", COMPLETIONS, _plus(b'{"prompt": "Once"}', b'"max_tokens": 1e999'), 400),
    ("max-tokens-10e400", COMPLETIONS, _plus(b'{"prompt": "Once"}', b'"max_tokens": ' + BIG), 400),
    (
        "max-tokens-5000-digits",
        COMPLETIONS,
        b'{"prompt": "O", "max_tokens": 1' + b"0" * 5000 + b"}",
        400,
    ),
    ("seed-10e400", COMPLETIONS, _plus(_prompt(), b'"seed": ' + BIG), 400),
    ("priority-minus-inf", COMPLETIONS, _plus(_prompt(), b'"priority": -1e999'), 400),
    ("temperature-nan", COMPLETIONS, b'{"prompt": "Once", "temperature": NaN}', 400),
    ("top-p-infinity", CHAT, _plus(_chat("hi"), b'"top_p": Infinity'), 400),
    ("penalty-nan", COMPLETIONS, _plus(_prompt(), b'"repetition_penalty": NaN'), 400),
    ("mega-prompt", COMPLETIONS, _prompt(MEGA), 400),
    ("mega-content", CHAT, _chat(MEGA), 400),
    ("mega-model", COMPLETIONS, _prompt(model=MEGA), 404),
    ("mega-stop", COMPLETIONS, _prompt(stop=MEGA), 400),
    ("mega-user", COMPLETIONS, _prompt(user=MEGA), 400),  # kept in the record: at most 512
    (
        "mega-tools",
        CHAT,
        _plus(
            _chat("hi"),
            b'"tools": [{"type": "function", "function": '
            b'{"name": "f", "description": "' + MEGA.encode() + b'"}}], "tool_choice": "none"',
        ),
        400,
    ),
    ("prompt-number", COMPLETIONS, b'{"prompt": 5}', 400),
    ("prompt-object", COMPLETIONS, b'{"prompt": {"$ne": 1}}', 400),
    ("prompt-token-too-big", COMPLETIONS, b'{"prompt": [4294967296]}', 400),
    ("prompt-token-out-of-vocab", COMPLETIONS, _prompt([100_000]), 400),
    ("messages-string", CHAT, b'{"messages": "hi"}', 400),
    ("role-robot", CHAT, b'{"messages": [{"role": "robot", "content": "hi"}]}', 400),
    ("max-tokens-string", COMPLETIONS, _prompt(max_tokens="many"), 400),
    ("stream-string", COMPLETIONS, _prompt(stream="maybe"), 400),
    ("stop-numbers", COMPLETIONS, _prompt(stop=[1, 2]), 400),
    ("top-level-null", COMPLETIONS, b"null", 400),
    ("top-level-string", CHAT, b'"hi"', 400),
    ("empty-object", CHAT, b"{}", 400),
    ("truncated", CHAT, b'{"messages": [', 400),
    ("nul-in-prompt", COMPLETIONS, _prompt("a\u0000b"), 200),
]


PARAMS = {  # the field a 400 names, where it names one
    "surrogate-content": "messages.0.content",
    "surrogate-part": "messages.0.content",
    "surrogate-name": "messages.0.name",
    "surrogate-user": "user",
    "mega-tools": "tools",
    "surrogate-kwargs": "chat_template_kwargs",
    "surrogate-regex": "guided_regex",
    "surrogate-grammar": "guided_grammar",
    "surrogate-structured": "structured_outputs",
    "utf8-surrogate-bytes": "prompt",
    "max-tokens-1e999": "max_tokens",
    "max-tokens-10e400": "max_tokens",
    "priority-minus-inf": "priority",
    "temperature-nan": "temperature",
    "prompt-number": "prompt",
    "stop-numbers": "stop",
    "role-robot": "messages.0.role",
    "truncated": None,
    "deep-prompt": None,
}


def _post(served: Served, path: str, body: bytes, content_type: str) -> httpx.Response:
    headers = {"content-type": content_type}
    return httpx.post(f"{served.url}{path}", content=body, headers=headers, timeout=60)


@pytest.mark.parametrize(("name", "path", "body", "expected"), CORPUS, ids=[c[0] for c in CORPUS])
def test_both_lanes_answer_alike_and_never_5xx(
    served: Served, name: str, path: str, body: bytes, expected: int
) -> None:
    fast, slow = (_post(served, path, body, content_type) for content_type in LANES.values())
    assert (fast.status_code, slow.status_code) == (expected, expected), (name, fast.text[:300])
    if expected == 200:
        return
    fast_error, slow_error = fast.json()["error"], slow.json()["error"]
    assert fast_error == slow_error, name
    assert set(fast_error) == {"message", "type", "param", "code"}
    assert fast_error["type"] in ("invalid_request_error", "not_found_error")
    assert len(fast_error["message"]) < 1000, fast_error["message"][:300]  # no echo of 1 MB
    assert not INTERNALS.search(fast_error["message"]), fast_error["message"]
    if name in PARAMS:
        assert fast_error["param"] == PARAMS[name], fast_error
    if "surrogate" in name:
        assert fast_error["param"] and "not valid Unicode" in fast_error["message"]
