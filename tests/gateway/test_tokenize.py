"""vLLM's /tokenize, /detokenize, /version and /ping against the served stories260K: the
tokens of the reference text are the kit's reference tokens (stories260K's greedy output from
BOS, tests/conftest.py), and they decode back to the text."""

from __future__ import annotations

import httpx

from tests.conftest import STORIES_REFERENCE_TOKENS
from tests.served import Served

TEXT = "Once upon a time, there was a little girl named Lily."


def _post(served: Served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, timeout=30)


def test_tokenize_and_detokenize_round_trip(served: Served) -> None:
    body = {"prompt": TEXT, "return_token_strs": True}
    out = _post(served, "/tokenize", body).json()
    assert out["tokens"][0] == 1  # BOS, as a completion's prompt
    assert out["tokens"][1:] == STORIES_REFERENCE_TOKENS[: out["count"] - 1]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    assert out["token_strs"][0] == "<s>"  # BOS as the vocabulary names it
    assert "".join(out["token_strs"][1:]).replace("\u2581", " ").strip() == TEXT
    plain = _post(served, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert plain["tokens"] == out["tokens"][1:] and plain["token_strs"] is None
    back = _post(served, "/detokenize", {"tokens": out["tokens"]}).json()
    # special tokens kept (vLLM's /detokenize: Hugging Face's default decode); after BOS
    # without the first piece's space
    assert back == {"prompt": "<s>" + TEXT}


def test_tokenize_chat_counts_what_a_chat_completion_prefills(served: Served) -> None:
    messages = [{"role": "user", "content": "Tim"}]
    out = _post(served, "/tokenize", {"messages": messages}).json()
    chat = {"messages": messages, "max_tokens": 1, "temperature": 0}
    usage = _post(served, "/v1/chat/completions", chat).json()["usage"]
    assert out["count"] == usage["prompt_tokens"]
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    joined = [{"role": "user", "content": "Hello\nworld"}]  # vLLM joins text parts so
    as_parts = _post(served, "/tokenize", {"messages": [{"role": "user", "content": parts}]})
    as_text = _post(served, "/tokenize", {"messages": joined})
    assert as_parts.json()["tokens"] == as_text.json()["tokens"]


def test_bad_bodies_and_other_models_are_clear_errors(served: Served) -> None:
    assert _post(served, "/tokenize", {"prompt": "a", "modle": "x"}).status_code == 400
    other = _post(served, "/tokenize", {"prompt": "a", "model": "gpt-4"})
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    bad = _post(served, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    # a chat body's error names the chat form's field, not the completion form's "prompt"
    for body, param in (
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "a"}], "foo": 1}, "foo"),
        ({"prompt": "a", "foo": 1}, "foo"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
    ):
        refused = _post(served, "/tokenize", body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, body
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = {"messages": [{"role": "user", "content": "Tim"}], "tools": tools}
    assert _post(served, "/tokenize", chat).status_code == 200  # vLLM's: rendered with them


def test_version_and_ping(served: Served) -> None:
    assert httpx.get(f"{served.url}/version", timeout=10).json()["version"]
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{served.url}/ping", timeout=10).status_code == 200
