"""The Responses API over the chat path: a request's input items (after the stored conversation
its ``previous_response_id`` names) become chat messages, its tools and ``text.format`` the chat
request's (the output: :mod:`gateway.responses_output`); errors raised on the chat path name
the Responses fields."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from gateway.errors import APIError
from gateway.openai_models import ChatCompletionRequest
from gateway.responses_models import LOGPROBS_INCLUDE, ResponsesRequest

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# The fields each input item and content part may carry: what the model sees, and the output's
# own ids, status and phase when a client replays a response's items (Agents SDK). Any other
# field is a 400 naming it, never dropped; a null one is absent (the openai types dump every
# optional field).
_ITEM_FIELDS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
}
_PART_FIELDS = {"type", "text", "refusal", "annotations", "logprobs"}
_TOOL_FIELDS: dict[str, Any] = {  # a function tool's fields and their types (None: absent)
    "name": str,
    "description": str | None,
    "parameters": dict | None,
    "strict": bool | None,
}


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that serves ``body``, after the stored conversation ``history`` (its
    input and output items, oldest first)."""
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options can only be given with stream: true", "stream_options")
    logprobs = LOGPROBS_INCLUDE in (body.include or [])
    if body.top_logprobs and not logprobs:
        raise APIError(
            400, f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]", param="top_logprobs"
        )
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += chat_messages(history, "previous_response_id")
    messages += chat_messages(_input_items(body.input), "input")
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": bool(body.stream),
        "logprobs": logprobs or None,
        "top_logprobs": body.top_logprobs if logprobs else None,
        "tools": [_chat_tool(t, i) for i, t in enumerate(body.tools)] if body.tools else None,
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "user": body.safety_identifier or body.user,
        "prompt_cache_key": body.prompt_cache_key,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "seed": body.seed,
        "priority": body.priority,
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # what the item checks above leave: a chat field's bounds
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error.get("loc", ()))
        raise APIError(400, f"input: {where}: {error.get('msg')}", param="input") from exc


def _input_items(value: str | list[Any]) -> list[Any]:
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


def chat_messages(items: list[Any], param: str) -> list[dict[str, Any]]:
    """Input items as chat messages: messages by role, consecutive ``function_call`` items
    as one assistant message's ``tool_calls``, ``function_call_output`` as ``tool`` messages."""
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"{param}.{index}"
        if not isinstance(item, dict):
            raise APIError(400, "an input item is an object", param=where)
        kind = item.get("type", "message")
        _only(item, _ITEM_FIELDS.get(kind), where)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _call_from_item(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str | list):
                raise APIError(400, "function_call_output is {call_id, output}", param=where)
            content = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            raise APIError(
                400,
                f"input items of type {str(kind)[:64]!r} are not served (message, "
                "function_call, function_call_output are)",
                param=f"{where}.type",
            )
    return messages


def _only(entry: dict[str, Any], allowed: set[str] | None, where: str) -> None:
    given = {key for key, value in entry.items() if value is not None}
    extra = sorted(given - allowed) if allowed is not None else []
    if extra:
        raise APIError(400, f"{extra[0][:64]!r} is not a field of this item", f"{where}.{extra[0]}")


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if role not in _ROLES:
        raise APIError(400, f"role is one of {', '.join(_ROLES)}", param=f"{where}.role")
    if isinstance(content, list):
        content = _text(content, f"{where}.content")
    elif not isinstance(content, str):
        raise APIError(400, "content is text or a list of text parts", param=f"{where}.content")
    return {"role": role, "content": content}


def _text(parts: list[Any], where: str) -> str:
    """The text of a content list; images, files and audio are refused, naming the part."""
    texts = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text", part.get("refusal")) if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(text, str):
            raise APIError(
                400,
                f"content parts of type {str(kind)[:64]!r} are not served (text only)",
                param=f"{where}.{index}.type",
            )
        _only(part, _PART_FIELDS, f"{where}.{index}")
        texts.append(text)
    return "".join(texts)


def _call_from_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
        raise APIError(400, "function_call is {call_id, name, arguments}", param=where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise APIError(
            400,
            f"tools of type {str(kind)[:64]!r} are not served (function tools are)",
            param=f"tools.{index}.type",
        )
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    unknown = sorted(set(tool) - {"type", *function})
    if unknown:
        message = f"{unknown[0][:64]!r} is not a field of a function tool"
        raise APIError(400, message, param=f"tools.{index}.{unknown[0][:64]}")
    for name, kinds in _TOOL_FIELDS.items():
        value = function.get(name)
        if not isinstance(value, kinds) or (name == "name" and not value):
            raise APIError(
                400,
                "a function tool is {type: function, name, description?, parameters?, strict?}",
                param=f"tools.{index}.{name}",
            )
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("name"), str)
        and set(choice) == {"type", "name"}
    ):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        400,
        'tool_choice is "none", "auto", "required" or {type: function, name}',
        param="tool_choice",
    )


_FORMAT_KEYS = {
    "text": {"type"},
    "json_object": {"type"},
    "json_schema": {"type", "name", "schema", "strict", "description"},
}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (``verbosity`` is refused)."""
    if not text:
        return None
    if set(text) - {"format", "verbosity"} or text.get("verbosity") not in (None, "medium"):
        raise APIError(400, "text takes format (verbosity is not served)", param="text")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    known = _FORMAT_KEYS.get(kind, set()) if isinstance(kind, str) else set()
    unknown = sorted(set(fmt) - known) if isinstance(fmt, dict) and known else []
    if unknown:
        param = f"text.format.{str(unknown[0])[:64]}"
        raise APIError(400, f"'{param}' is not a field of format type {kind}", param=param)
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if (
        kind == "json_schema"
        and isinstance(fmt, dict)
        and isinstance(fmt.get("schema"), dict)
        and isinstance(fmt.get("name"), str)
        and fmt["name"]
        and isinstance(fmt.get("strict"), bool | None)
    ):
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise APIError(
        400,
        "text.format is {type: text | json_object | json_schema (with name and schema)}",
        param="text.format",
    )


def stored_items(body: ResponsesRequest) -> list[Any]:
    """What of this request a later ``previous_response_id`` continues from: its input items
    (``instructions`` are not carried over, as OpenAI's)."""
    return _input_items(body.input)


# chat fields -> the Responses fields they came from, for errors raised on the chat path
_FIELDS = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
    "logprobs": "include",
}
_FIELD_WORDS = re.compile(r"\b(max_tokens|max_completion_tokens|response_format)\b")


def as_responses_error(exc: APIError) -> APIError:
    """``exc`` from the chat path, naming the Responses request's fields (``max_output_tokens``,
    not ``max_tokens``)."""
    if exc.param:
        head, _, rest = exc.param.partition(".")
        if head in _FIELDS:
            exc.param = _FIELDS[head]
        elif head == "tools" and ".function" in rest:
            exc.param = f"tools.{rest.partition('.')[0]}"
    exc.message = _FIELD_WORDS.sub(lambda m: _FIELDS[m.group(1)], exc.message)
    return exc
