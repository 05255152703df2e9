"""The OpenAI Responses API's request body (``POST /v1/responses``), as vLLM serves it: text in,
text and function calls out, stored for ``previous_response_id``.

Input items, tools, ``tool_choice`` and ``text.format`` are taken as JSON here and checked where
they are turned into a chat request (:mod:`gateway.responses`), so that a 400 names the item
(``input.3.content.0.type``) instead of listing every member of a union that did not match.
Fields this server does not serve are declared loosely and refused with a 400 naming them
(:data:`UNSUPPORTED_RESPONSE_FIELDS`); an unknown field is a 400 too."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.errors import APIError
from gateway.openai_models import NumLogprobs, PositiveInt, valid_unicode

MAX_INPUT_ITEMS = 4096
MAX_METADATA_KEYS = 16  # OpenAI's limits: 16 pairs, keys of 64 and values of 512 characters
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_obfuscation: bool | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | Annotated[list[Any], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: NumLogprobs | None = None
    include: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = None  # None: stored (OpenAI's default) when this server keeps them
    previous_response_id: Annotated[str, Field(max_length=256)] | None = None
    tools: Annotated[list[Any], Field(max_length=128)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA_KEYS)] | None = None
    user: Annotated[str, Field(max_length=512)] | None = None
    safety_identifier: Annotated[str, Field(max_length=512)] | None = None
    # requests with the same key go to the same worker (where its prefix cache is)
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    # vLLM's extra sampling fields, applied as in chat completions
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    # refused unless at their defaults (UNSUPPORTED_RESPONSE_FIELDS)
    background: Any = None
    conversation: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    reasoning: Any = None
    service_tier: Any = None
    truncation: Any = None

    _text = field_validator(
        "model", "input", "instructions", "tools", "tool_choice", "text", "metadata", "user"
    )(valid_unicode)

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, text in (value or {}).items():
            if len(key) > 64 or len(text) > 512:
                raise ValueError("metadata keys are at most 64 characters, values 512")
        return value


# field -> (accepted values besides null, why the others are refused)
UNSUPPORTED_RESPONSE_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((False,), "responses are not run in the background"),
    "conversation": ((), "conversations are not stored; use previous_response_id"),
    "max_tool_calls": ((), "the number of tool calls is not capped"),
    "prompt": ((), "no stored prompt templates"),
    "reasoning": (({},), "this server runs no reasoning models' effort control"),
    "service_tier": (("auto", "default"), "one tier; SLO classes are x-slo-class"),
    "truncation": (("disabled",), "an input over the context is a 400, never truncated"),
}


def reject_unsupported_response_fields(body: ResponsesRequest) -> None:
    for name, (accepted, why) in UNSUPPORTED_RESPONSE_FIELDS.items():
        value = getattr(body, name)
        if value is not None and not any(
            value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepted
        ):
            raise APIError(400, f"'{name}' is not supported: {why}", param=name)
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise APIError(
            400,
            "stream_options.include_obfuscation is not supported: deltas carry no padding",
            param="stream_options.include_obfuscation",
        )
    for index, item in enumerate(body.include or []):
        if item != LOGPROBS_INCLUDE:
            raise APIError(
                400, f"include: only {LOGPROBS_INCLUDE!r} is served", param=f"include.{index}"
            )
