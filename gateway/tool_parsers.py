"""The tool calls in a model's output: the ``hermes`` parser (Hermes, Qwen2.5:
``<tool_call>{"name", "arguments"}</tool_call>``) and ``llama3_json`` (Llama 3.x: JSON objects
``{"name", "parameters"}`` separated by ``;``), and how much of a streamed output must wait
because it may begin a call."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
HERMES_TAG = "<tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function"}
        call["function"] = {"name": self.name, "arguments": self.arguments}
        return call if index is None else {"index": index, **call}


def as_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # arguments' text as the model wrote it


def parse_calls(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """``text`` as (content, tool calls) in ``parser``'s format; no call found: all content."""
    if parser == "hermes":
        start = text.find(HERMES_TAG)
        if start < 0:
            return text, []
        found = [_call(raw, "arguments") for raw in _HERMES_CALL.findall(text[start:])]
        if not found or None in found:
            return text, []
        return text[:start], [c for c in found if c is not None]
    calls = _llama3_calls(text)
    return ("", calls) if calls else (text, [])


def _llama3_calls(text: str) -> list[ToolCall]:
    """Llama 3.x's calls: JSON objects separated by ``;`` (a ``;`` inside an argument string
    is the argument's); none unless the whole text is calls."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    at = len(text) - len(text.lstrip())
    while at < len(text):
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return []
        call = _call_of(value, "parameters")
        if call is None:
            return []
        calls.append(call)
        rest = text[end:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return []
        at = len(text) - len(rest)
    return calls


def _call(raw: str, arguments_key: str) -> ToolCall | None:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return _call_of(value, arguments_key)


def _call_of(value: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    return ToolCall(value["name"], as_json(arguments))


def held_back(parser: str, text: str) -> int:
    """How many characters at the end of streamed ``text`` must wait (they may begin a call):
    all of it once a call began, or a partial tag at the end."""
    if parser == "llama3_json":
        return len(text) if text.lstrip().startswith("{") or not text.strip() else 0
    if HERMES_TAG in text:
        return len(text) - text.find(HERMES_TAG)
    for size in range(min(len(HERMES_TAG) - 1, len(text)), 0, -1):
        if HERMES_TAG.startswith(text[-size:]):
            return size
    return 0
