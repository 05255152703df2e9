"""OpenAI request bodies (vLLM's extras: top_k, ignore_eos, priority, repetition_penalty,
chat_template_kwargs, continue_final_message). Every number is bounded so that no input can fail
later than validation. An unknown field is a 400 naming it (vLLM ignores them: a client's typo
or a feature it counts on would be served as if it were not there). Fields we do not serve are
declared loosely, so that :mod:`gateway.unsupported` answers them with its own clear 400.

Text must be valid Unicode: JSON can carry a lone surrogate (``"\\ud800"``) that no tokenizer or
UTF-8 encoder takes, so every text field that is used (prompt, message content and name, stop,
model, user, chat_template_kwargs) refuses one with a 400 naming the field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from shared.logprobs import MAX_LOGPROBS

_MAX_INT = 2**31 - 1
PositiveInt = Annotated[int, Field(ge=1, le=_MAX_INT)]
TokenId = Annotated[int, Field(ge=0, le=_MAX_INT)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
MAX_USER_CHARS = 512  # OpenAI's ``user``: an end-user id


def valid_unicode(value: Any) -> Any:
    """``value`` when no string in it (however nested) holds a lone surrogate."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise PydanticCustomError(
                        "invalid_unicode", "text is not valid Unicode (a lone surrogate)"
                    ) from None
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
        elif isinstance(item, BaseModel):
            pending.extend(vars(item).values())
    return value


class StreamOptions(BaseModel):
    """vLLM's: usage at the end unless ``include_usage`` is false or null; with
    ``continuous_usage_stats`` also in every chunk (that choice's running counts)."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None  # vLLM's: no upper bound
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=_MAX_INT)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # vLLM's int64
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=_MAX_INT)] | None = None
    best_of: Annotated[int, Field(ge=1, le=_MAX_INT)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # vLLM's extra sampling fields, applied
    min_tokens: Annotated[int, Field(ge=0, le=_MAX_INT)] = 0
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # no effect: special tokens are never in text
    priority: Annotated[int, Field(ge=-(2**31), le=_MAX_INT)] = 0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    logit_bias: Annotated[dict[str, Any], Field(max_length=1024)] | None = None
    response_format: Any = None
    # OpenAI's end-user id (abuse monitoring): kept in the request's lifecycle record
    user: str | None = None
    # OpenAI fields this server does not serve beyond their defaults (gateway.unsupported)
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    prompt_logprobs: NumLogprobs | None = None  # vLLM's: the prompt tokens' log-probabilities
    # OpenAI's: requests with the same key go to the same worker (its prefix cache)
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None

    _sampling_text = field_validator(
        "model",
        "stop",
        "user",
        "prompt_cache_key",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    )(valid_unicode)

    @field_validator("user")
    @classmethod
    def _short_user(cls, value: str | None) -> str | None:
        """An id, kept in the lifecycle record: not a place for a megabyte."""
        if value is not None and len(value) > MAX_USER_CHARS:
            raise ValueError(f"at most {MAX_USER_CHARS} characters, got {len(value)}")
        return value

    @field_validator("stream", mode="before")
    @classmethod
    def _stream_null_is_false(cls, value: Any) -> Any:
        """OpenAI's schema allows ``stream: null``: not streamed."""
        return False if value is None else value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message of the conversation. An assistant message sent back as the client got it
    (``message.model_dump()``) carries OpenAI's output fields too: ``refusal`` is its text when
    it has no content, ``reasoning_content`` (vLLM's) goes to the template, ``parsed`` (the
    client's own parse of ``content``) is the content again; ``audio``, ``function_call`` and
    ``annotations`` are taken only empty."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls, in a history
    tool_call_id: str | None = None  # a tool message's answer to that call
    refusal: str | None = None
    reasoning_content: str | None = None
    parsed: Any = None
    audio: None = None
    function_call: None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None

    _text = field_validator("content", "name", "refusal", "reasoning_content")(valid_unicode)

    @field_validator("tool_calls", "tool_call_id")
    @classmethod
    def _field_of_its_role(cls, value: Any, info: ValidationInfo) -> Any:
        """``tool_calls`` belong to an assistant message, ``tool_call_id`` to a tool message:
        elsewhere nothing would read them."""
        role = info.data.get("role")
        owner = "assistant" if info.field_name == "tool_calls" else "tool"
        if value and role is not None and role != owner:
            raise ValueError(f"{info.field_name} is a field of {owner} messages, not of {role}")
        return value

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # vLLM's join of text parts


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None
    tools: Annotated[list[Any], Field(max_length=128)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    _kwargs_text = field_validator("chat_template_kwargs")(valid_unicode)

    _tools_text = field_validator("tools", "tool_choice")(valid_unicode)


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | list[str] | list[list[TokenId]]
    # 0 only with echo: the prompt alone comes back (with its log-probabilities, if asked)
    max_tokens: Annotated[int, Field(ge=0, le=_MAX_INT)] | None = None
    echo: bool | None = None
    logprobs: NumLogprobs | None = None
    suffix: str | None = None

    _prompt_text = field_validator("prompt")(valid_unicode)
