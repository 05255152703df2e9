"""The OpenAI (and vLLM) request fields this server does not serve: one table for both
endpoints, checked by the endpoint functions that the fast lane and FastAPI's routes share.

A field at its null or default value (``tools: null``, ``n: 1``, penalties 0,
``response_format: {"type": "text"}``...) is accepted, since clients send those; any other value
is a 400 whose ``param`` is the field and whose message names it and says it is not supported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from gateway.errors import APIError

Accepts = Callable[[Any], bool]


def _one_of(*allowed: Any) -> Accepts:
    """None, or a value equal to one of ``allowed`` (and of the same type: ``0`` is not
    ``False``, ``1`` is ``1.0``)."""

    def accepts(value: Any) -> bool:
        return value is None or any(
            value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed
        )

    return accepts


_EMPTY = _one_of([], {}, "")

# field -> (accepts, why), in the order they are checked. Fields a request model lacks (echo on
# chat) are never set on it.
UNSUPPORTED: dict[str, tuple[Accepts, str]] = {
    "functions": (_EMPTY, "this server does not call functions"),
    "function_call": (_one_of("none", "auto"), "only 'none' (or 'auto' without functions)"),
    "best_of": (_one_of(1), "only best_of = 1"),
    "suffix": (_EMPTY, "no text is inserted after the completion"),
    "skip_special_tokens": (_one_of(True), "special tokens are always left out of the text"),
    "store": (_one_of(False), "completions are not stored"),
    "metadata": (_EMPTY, "completions are not stored"),
    "service_tier": (_one_of("auto", "default"), "one tier; SLO classes are x-slo-class"),
    "modalities": (_one_of(["text"]), 'only ["text"]'),
    "audio": (_EMPTY, "text only"),
    "prediction": (_EMPTY, "no predicted outputs"),
    "reasoning_effort": (_one_of(), "this server runs no reasoning models' effort control"),
    "web_search_options": (_EMPTY, "no web search"),
}


def reject_unsupported(body: BaseModel) -> None:
    """400 for the first field of ``body`` set to a value this server does not serve."""
    fields = type(body).model_fields
    for name, (accepts, why) in UNSUPPORTED.items():
        if name in fields and not accepts(getattr(body, name)):
            raise APIError(400, f"'{name}' is not supported: {why}", param=name)
