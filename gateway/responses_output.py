"""The Responses API's output: the response object, its output items (one ``message`` with its
``output_text``, then one ``function_call`` item per tool call) and its streamed events'
bytes."""

from __future__ import annotations

import json
import uuid
from typing import Any

from gateway.responses_models import ResponsesRequest
from gateway.tool_parsers import ToolCall


def message_item(text: str, logprobs: list[Any] | None, status: str) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def status_of(finish_reason: str | None) -> str:
    """A generation's status: ``incomplete`` when ``max_output_tokens`` cut it."""
    return "incomplete" if finish_reason == "length" else "completed"


def call_item(call: ToolCall, finish_reason: str | None = None) -> dict[str, Any]:
    """A function call item: ``incomplete`` when max_output_tokens cut its arguments (they
    are then not JSON)."""
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "incomplete" if finish_reason == "length" and _cut(call) else "completed",
    }


def _cut(call: ToolCall) -> bool:
    try:
        json.loads(call.arguments)
    except json.JSONDecodeError:
        return True
    return False


def response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": usage["prompt_tokens_details"],
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def response_head(body: ResponsesRequest, response_id: str, created_s: int) -> dict[str, Any]:
    """Every field of a response object but its status, output and usage: the request's
    settings as served."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_s,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "model": body.model,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_logprobs": body.top_logprobs,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "user": body.user,
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "service_tier": "default",  # the one tier ("auto" resolves to it)
        "background": False,
    }


def finished(
    head: dict[str, Any], output: list[dict[str, Any]], reason: str | None, usage: dict[str, Any]
) -> dict[str, Any]:
    """The response object once generation ended (``incomplete`` when cut by
    ``max_output_tokens``)."""
    status = status_of(reason)
    return {
        **head,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": output,
        "usage": response_usage(usage),
    }


def event_bytes(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
