"""Tool calling as vLLM serves it: ``tools``, ``tool_choice`` (``none``, ``auto``, ``required``,
a named function) and ``parallel_tool_calls``.

- ``required`` and a named function are enforced with structured outputs, so the arguments
  always parse and match the tool's schema: ``required`` generates a JSON array of
  ``{"name", "parameters"}`` (one item without ``parallel_tool_calls``), a named function its
  arguments object; the output is then the call(s), whatever the model's own format.
- ``auto`` (vLLM: ``--enable-auto-tool-choice`` with ``--tool-call-parser``) renders the tools
  in the chat template and parses the model's own format: ``hermes`` (Hermes, Qwen2.5:
  ``<tool_call>{"name", "arguments"}</tool_call>``) or ``llama3_json`` (Llama 3.x: a JSON
  object ``{"name", "parameters"}``, several separated by ``;``; :mod:`gateway.tool_parsers`).
  Text before the first call is the message's content; output that does not parse stays
  content.
- ``none`` generates text; the tools are still rendered (vLLM's default: a history's calls
  name functions the prompt defines), unless ``exclude_tools_when_tool_choice_none``.
- ``parallel_tool_calls: false`` keeps the first call of an ``auto`` output (``required``
  generates one)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.errors import APIError
from gateway.openai_models import ChatCompletionRequest
from gateway.tool_parsers import ToolCall, as_json, held_back, parse_calls
from shared.sampling import StructuredOutput

PARSERS = ("hermes", "llama3_json")
# The tools of one request as JSON (128 tools of 2 KiB are 256 KiB): a template that does not
# render them leaves them out of the prompt's bound, and the Responses API stores them.
MAX_TOOLS_JSON_BYTES = 512 * 1024


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tools make of its generation: ``mode`` none / auto / required /
    named; ``structured``: the grammar that enforces required and named; ``render``: whether
    the template gets the tools; ``parser`` for auto; ``named``: the named function."""

    mode: str
    structured: StructuredOutput | None = None
    render: bool = False
    parser: str | None = None
    named: str | None = None
    parallel: bool = True  # parallel_tool_calls: false keeps one call

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"


def plan_tools(
    body: ChatCompletionRequest,
    auto_enabled: bool,
    parser: str | None,
    exclude_tools_when_none: bool = False,
) -> ToolPlan:
    """The request's tool plan; 400 naming the field for a choice that cannot be served."""
    tools = body.tools or []
    if tools and len(json.dumps(tools)) > MAX_TOOLS_JSON_BYTES:
        message = f"the tools take more than {MAX_TOOLS_JSON_BYTES} bytes as JSON"
        raise APIError(400, message, "tools")  # a template may not render them: never counted
    functions = {_function(t, i)["name"]: _function(t, i) for i, t in enumerate(tools)}
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or not tools:
        if choice not in ("none", "auto"):
            wanted = "required" if choice == "required" else "a named function"
            raise APIError(
                400, f"tool_choice {wanted} needs tools, and none are given", "tool_choice"
            )
        return ToolPlan("none", render=bool(tools) and not exclude_tools_when_none)
    parallel = body.parallel_tool_calls is not False
    if choice == "auto":
        if not (auto_enabled and parser):
            raise APIError(
                400,
                '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                "--tool-call-parser (or tool_choice required / a named function)",
                param="tool_choice",
            )
        return ToolPlan("auto", render=True, parser=parser, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", _required_output(functions, parallel), render=True)
    name = _named(choice)
    if name not in functions:
        raise APIError(400, f"tool_choice names {name[:64]!r}, not one of the tools", "tool_choice")
    schema = functions[name].get("parameters") or {"type": "object"}
    return ToolPlan("named", StructuredOutput("json", json.dumps(schema)), True, named=name)


def _required_output(functions: dict[str, dict[str, Any]], parallel: bool) -> StructuredOutput:
    """A JSON array of ``{name, parameters}`` calls, each tool's ``$defs`` / ``definitions``
    (what ``openai.pydantic_function_tool`` writes for nested models) lifted to the array's
    root under the same key, so that their ``#/$defs/...`` references resolve there."""
    lifted: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    items = []
    for index, (name, function) in enumerate(functions.items()):
        parameters = dict(function.get("parameters") or {"type": "object"})
        for key, defs in lifted.items():
            for def_name, schema in (parameters.pop(key, None) or {}).items():
                if defs.setdefault(def_name, schema) != schema:
                    raise APIError(
                        400,
                        f"tools define {key} {def_name!r} differently: required calls "
                        "share one schema",
                        param=f"tools.{index}.function.parameters",
                    )
        if _has_root_refs(parameters):  # "#" or "#/properties/..." meant the tool's own root
            own = f"__tool_{index}"
            lifted["$defs"][own] = _rebased(parameters, f"#/$defs/{own}")
            parameters = {"$ref": f"#/$defs/{own}"}
        items.append(_call_schema(name, parameters))
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    array |= {key: defs for key, defs in lifted.items() if defs}
    return StructuredOutput("json", json.dumps(array))


_LIFTED_REFS = ("#/$defs/", "#/definitions/")


def _refs(schema: Any) -> list[str]:
    """Every ``$ref`` string inside ``schema``."""
    if isinstance(schema, dict):
        own = [schema["$ref"]] if isinstance(schema.get("$ref"), str) else []
        return own + [ref for value in schema.values() for ref in _refs(value)]
    if isinstance(schema, list):
        return [ref for value in schema for ref in _refs(value)]
    return []


def _has_root_refs(parameters: dict[str, Any]) -> bool:
    """Whether a reference points at the parameters' own root (not at the lifted defs)."""
    return any(r.startswith("#") and not r.startswith(_LIFTED_REFS) for r in _refs(parameters))


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with its root-relative references (``#``, ``#/properties/...``) moved under
    ``base``; those into the lifted ``$defs`` / ``definitions`` stay."""
    if isinstance(schema, list):
        return [_rebased(value, base) for value in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rebased(value, base) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(_LIFTED_REFS):
        out["$ref"] = base + ref[1:]
    return out


def _function(tool: Any, index: int) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not (
        isinstance(tool, dict)
        and tool.get("type", "function") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and function["name"]
        and isinstance(function.get("parameters") or {}, dict)
    ):
        raise APIError(
            400,
            "a tool is {type: function, function: {name, description?, parameters?, strict?}}",
            param=f"tools.{index}",
        )
    for where, given, known in (("", tool, _TOOL_KEYS), (".function", function, _FUNCTION_KEYS)):
        unknown = sorted(set(given) - known)
        if unknown:
            param = f"tools.{index}{where}.{unknown[0][:64]}"
            raise APIError(400, f"'{param}' is not a field", param=param)
    return function


_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return str(function["name"])
    raise APIError(
        400,
        'tool_choice is "none", "auto", "required" or {type: function, function: {name}}',
        param="tool_choice",
    )


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


# A required call cut after its name: {"name": "...", "parameters": <as far as it came>
_CUT_CALL = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*(.*)', re.S
)


def cut_calls(plan: ToolPlan, text: str) -> list[ToolCall]:
    """The calls of an enforced output that max_tokens cut, as OpenAI returns a cut call: the
    whole ones, then the last one's name with its arguments as far as they came (none when
    its name was cut)."""
    if plan.mode == "named" and plan.named is not None:
        return [ToolCall(plan.named, text.strip())] if text.strip() else []
    calls: list[ToolCall] = []
    decoder, at = json.JSONDecoder(), text.find("[") + 1
    while at > 0:
        at = len(text) - len(text[at:].lstrip(" \n\t\r,"))
        try:
            call, at = decoder.raw_decode(text, at)
            calls.append(ToolCall(call["name"], as_json(call["parameters"])))
        except (json.JSONDecodeError, KeyError, TypeError):
            cut = _CUT_CALL.match(text, at)
            if cut is not None:
                calls.append(ToolCall(json.loads(cut[1]), cut[2]))
            break
    return calls


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [dict(t) for t in body.tools or []]


def enforced_calls(plan: ToolPlan, text: str) -> list[ToolCall]:
    """The call(s) in a required or named output (the grammar made it parse); a named call's
    arguments are the text as generated."""
    if plan.mode == "named" and plan.named is not None:
        json.loads(text)  # raises where max_tokens cut it
        return [ToolCall(plan.named, text.strip())]
    return [ToolCall(c["name"], as_json(c["parameters"])) for c in json.loads(text)]


def history_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages for the template, with assistant ``tool_calls`` (their ``arguments`` JSON
    text as objects, as templates expect, as vLLM does) and ``tool`` messages' ids."""
    out = []
    for index, message in enumerate(body.messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            calls = enumerate(message.tool_calls)
            entry["tool_calls"] = [_history_call(c, f"messages.{index}", i) for i, c in calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            entry["name"] = message.name
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        out.append(entry)
    return out


_HISTORY_CALL_KEYS = frozenset({"id", "type", "function", "index"})
_HISTORY_FUNCTION_KEYS = frozenset({"name", "arguments", "parsed_arguments"})


def _history_call(call: Any, where: str, num: int) -> dict[str, Any]:
    """An assistant's tool call in a history, its arguments parsed for the template; a call
    as the openai client gives it back (``index`` of a streamed call, ``parsed_arguments`` of a
    parsed one: output fields, as the message's ``parsed``) passes, any other field is a 400."""
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise APIError(400, "a tool call is {id, type, function: {name, arguments}}", where)
    for part, given, known in (
        ("", call, _HISTORY_CALL_KEYS),
        (".function", function, _HISTORY_FUNCTION_KEYS),
    ):
        unknown = sorted(str(key) for key in set(given) - known)
        if unknown:
            param = f"{where}.tool_calls.{num}{part}.{unknown[0][:64]}"
            raise APIError(400, f"'{param}' is not a field of a tool call", param)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError as exc:
            raise APIError(400, f"tool call arguments are not JSON: {exc}", where) from exc
    kept = {key: value for key, value in call.items() if key != "index"}  # output fields go
    return {**kept, "function": {"name": function["name"], "arguments": arguments}}


def assistant_message(
    plan: ToolPlan, text: str, reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A whole choice's message and finish reason: its tool calls when the plan made or found
    any, else its text (an enforced output cut by max_tokens: the calls as far as they came,
    finish reason ``length``)."""
    content, calls = split_output(plan, text, reason)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content if content or not calls else None,
    }
    if calls:
        message["tool_calls"] = [call.as_openai() for call in calls]
        reason = calls_finish_reason(plan, reason)
    return message, reason


def calls_finish_reason(plan: ToolPlan, reason: str | None) -> str | None:
    """``tool_calls``, or ``stop`` for a named function (OpenAI's and vLLM's: the caller chose
    the call, the model did not); ``length`` for calls cut by max_tokens."""
    return reason if plan.mode == "named" or reason == "length" else "tool_calls"


def split_output(plan: ToolPlan, text: str, reason: str | None) -> tuple[str, list[ToolCall]]:
    """A choice's content and calls: an enforced output is all calls (cut by max_tokens: the
    calls as far as they came, never the enforcing JSON as content)."""
    if plan.mode in ("required", "named"):
        try:
            return "", enforced_calls(plan, text) if reason != "length" else cut_calls(plan, text)
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []
    if plan.mode == "auto" and plan.parser is not None:
        content, calls = parse_calls(plan.parser, text)
        return content, calls if plan.parallel else calls[:1]
    return text, []


@dataclass(slots=True)
class ToolStream:
    """A streamed choice's text under a tool plan: content goes out as it comes except what
    may be (part of) a call, held until the end, when the calls are parsed."""

    plan: ToolPlan
    text: str = ""
    num_sent: int = 0

    def feed(self, text: str) -> str:
        """The content ``text`` releases now."""
        self.text += text
        if self.plan.mode in ("required", "named"):
            return ""
        pending = self.text[self.num_sent :]
        parser = self.plan.parser or "hermes"
        # llama3_json: once content came first, no call follows in that format
        late = parser == "llama3_json" and self.num_sent > 0
        hold = 0 if late else held_back(parser, pending)
        release = pending[: len(pending) - hold]
        self.num_sent += len(release)
        return release

    def finish(self, reason: str | None) -> tuple[str, list[ToolCall]]:
        """At the end: the content still held, and the calls."""
        if self.plan.mode in ("required", "named"):
            return split_output(self.plan, self.text, reason)
        content, calls = split_output(self.plan, self.text, reason)
        if not calls:
            return self.text[self.num_sent :], []
        return content[self.num_sent :], calls
