"""A streamed response's events checked with the openai SDK's own types (their validation is
the reference): tokens with no text (the end of turn) still stream their log-probabilities, a
call cut by max_output_tokens is ``incomplete``, and a failure keeps what was streamed."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage

from gateway.logprobs_format import TokenNames
from gateway.responses_output import call_item
from gateway.responses_routes import _Events, _MessageStream
from gateway.tool_parsers import ToolCall
from shared.logprobs import TokenLogprobs


def _stream() -> _MessageStream:
    names = TokenNames(lambda t: "" if t == 2 else f"t{t}", lambda t: b"" if t == 2 else b"t")
    state: Any = SimpleNamespace(prompts=SimpleNamespace(token_names=names))
    return _MessageStream(_Events(), state, with_logprobs=True)


def _logprobs(*values: float) -> TokenLogprobs:
    n = len(values)
    return TokenLogprobs(list(values), [1] * n, [[]] * n, [[]] * n)


def _events(chunks: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(c.decode().split("data: ", 1)[1]) for c in chunks]


def test_the_end_of_turns_logprob_streams_in_a_last_delta() -> None:
    stream = _stream()
    chunks = stream.text("Hi", (5,), _logprobs(-0.5))
    chunks += stream.text("", (2,), _logprobs(-0.1))  # EOS: no text
    chunks += stream.finish("stop", [], "stop")
    events = _events(chunks)
    deltas = [p for e in events if e["type"] == "response.output_text.delta" for p in e["logprobs"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert [p["logprob"] for p in deltas] == [-0.5, -0.1] and done["logprobs"] == deltas
    item = next(e for e in events if e["type"] == "response.output_item.done")["item"]
    ResponseOutputMessage.model_validate(item, strict=True)
    assert item["content"][0]["logprobs"] == deltas


def test_a_call_cut_by_max_output_tokens_is_incomplete() -> None:
    cut = call_item(ToolCall("weather", '{"city'), "length")
    whole = call_item(ToolCall("weather", '{"city": "Paris"}'), "length")
    for item, status in ((cut, "incomplete"), (whole, "completed")):
        assert ResponseFunctionToolCall.model_validate(item).status == status
    assert call_item(ToolCall("weather", "{}"), "tool_calls")["status"] == "completed"


def test_a_failed_stream_keeps_the_open_message() -> None:
    stream = _stream()
    stream.text("Once upon", (5, 6), _logprobs(-0.5, -0.2))
    (item,) = stream.output_so_far()
    message = ResponseOutputMessage.model_validate(item)
    assert message.status == "incomplete" and message.content[0].text == "Once upon"  # type: ignore[union-attr]
    stream.finish("stop", [], "stop")
    assert [i["status"] for i in stream.output_so_far()] == ["completed"]
