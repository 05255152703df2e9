"""`/v1`: chat completions, completions (streaming and not) and models, in OpenAI's and vLLM's
shapes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.admission_routes import admit_and_start, chat_prompt, owned, tool_plan
from gateway.choices import (
    ChatChunkLogprobs,
    Choice,
    ChoiceStream,
    CompletionChunkLogprobs,
    collect,
    error_event,
    merged_events,
    running_usage,
    usage,
)
from gateway.errors import APIError
from gateway.fastlane import FastRoutes
from gateway.logprobs_format import Decode, vllm_prompt_logprobs
from gateway.openai_models import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.sse import ChunkBuilder, ChunkFormat, SseResponse
from gateway.state import GatewayState
from gateway.tenancy import authenticate
from gateway.tokenize_routes import router as tokenize_router
from gateway.tools import ToolStream, assistant_message, template_tools

router = APIRouter()
router.include_router(tokenize_router)  # /tokenize, /detokenize, /version, /ping


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    await authenticate(state, request)
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    """OpenAI's ``client.models.retrieve``: the served model, 404 for any other."""
    state = _state(request)
    await authenticate(state, request)
    if model_id != state.model_name:
        name = model_id if len(model_id) <= 200 else f"{model_id[:200]}..."
        raise APIError(404, f"the model {name!r} does not exist", "model", "model_not_found")
    return _model_card(state)


def _model_card(state: GatewayState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started_s),
        "owned_by": "superinfer",
        "root": state.model_name,
        "max_model_len": state.directory.max_model_len(),
    }


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request
) -> JSONResponse | SseResponse:
    state = _state(request)
    max_tokens = body.max_completion_tokens or body.max_tokens
    plan = tool_plan(state, body)
    tools = template_tools(body) if plan.render else None
    prompts = chat_prompt(state, body, tools)
    choices = await admit_and_start(
        state, request, body, prompts, max_tokens, "chatcmpl-", plan.structured
    )
    request_id, names = _response_id(choices), state.prompts.token_names
    head = {"id": request_id, "created": int(time.time()), "model": state.model_name}
    if body.stream:
        streams = [
            ChoiceStream(
                c,
                _chat_chunk(head, c),
                first={"role": "assistant", "content": ""},
                chunk_logprobs=ChatChunkLogprobs(names) if body.logprobs else None,
                tools=ToolStream(plan) if plan.calls_tools else None,
            )
            for c in choices
        ]
        return _sse(streams, body, request_id)
    await collect(choices, request)
    response: dict[str, Any] = {**head, "object": "chat.completion", "choices": []}
    for c in choices:
        message, reason = assistant_message(plan, c.text, c.generation.finish_reason)
        logprobs = c.chat_logprobs(names) if body.logprobs else None
        response["choices"].append(
            {"index": c.index, "message": message, "logprobs": logprobs, **_finish(c, reason)}
        )
    response["usage"] = usage(choices)
    if body.prompt_logprobs is not None:  # vLLM's place for it: the response's
        response["prompt_logprobs"] = _prompt_logprobs(choices[0], names.text)
    return _json(response, request_id)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | SseResponse:
    state = _state(request)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's and vLLM's default
    if max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens 0 needs echo: true", param="max_tokens")
    prompts = state.prompts.completion(body.prompt)
    choices = await admit_and_start(state, request, body, prompts, max_tokens, "cmpl-")
    request_id, decode = _response_id(choices), state.prompts.token_text
    if body.echo:
        with owned(state, choices):
            await _set_echo(state, body, choices, echo_only=max_tokens == 0)
    head = {"id": request_id, "created": int(time.time()), "model": state.model_name}
    with_logprobs = body.logprobs is not None
    if body.stream:
        streams = [
            ChoiceStream(
                c,
                _completion_chunk(head, c),
                chunk_logprobs=CompletionChunkLogprobs(decode) if with_logprobs else None,
            )
            for c in choices
        ]
        return _sse(streams, body, request_id)
    await collect(choices, request)
    response: dict[str, Any] = {**head, "object": "text_completion", "choices": []}
    for c in choices:
        choice = {"index": c.index, "text": c.text, "logprobs": None}
        if with_logprobs:
            choice["logprobs"] = c.completion_logprobs(decode)
        choice |= _finish(c, c.generation.finish_reason)
        if body.prompt_logprobs is not None:  # vLLM's place for it: each choice's
            choice["prompt_logprobs"] = _prompt_logprobs(c, decode)
        response["choices"].append(choice)
    response["usage"] = usage(choices)
    return _json(response, request_id)


def fast_routes() -> FastRoutes:
    """The routes above for :class:`gateway.fastlane.FastLane`: path -> (body model, endpoint)."""
    return {
        "/v1/chat/completions": (ChatCompletionRequest, chat_completions),
        "/v1/completions": (CompletionRequest, completions),
    }


def _response_id(choices: list[Choice]) -> str:
    """The response's id: its one choice's, or what every choice's id starts with."""
    first = choices[0].generation.request_id
    return first if len(choices) == 1 else first.removesuffix("-0")


async def _set_echo(
    state: GatewayState, body: CompletionRequest, choices: list[Choice], echo_only: bool
) -> None:
    """Each choice's prompt text first: the text as sent, or its token ids decoded."""
    prompt_field: Any = body.prompt
    one = isinstance(prompt_field, str) or isinstance(prompt_field[0], int)
    texts: list[Any] = [prompt_field] if one else list(prompt_field)
    n = body.n or 1
    for choice in choices:
        prompt = texts[choice.index // n]
        if isinstance(prompt, str):
            choice.echo = prompt
        else:
            (choice.echo,) = await state.prompts.decode(list(prompt))
        choice.echo_only = echo_only


def _prompt_logprobs(choice: Choice, decode: Decode) -> list[Any] | None:
    generation = choice.generation
    if generation.prompt_logprobs is None:
        return None
    return vllm_prompt_logprobs(generation.params.prompt_token_ids, generation.prompt_logprobs,
                                decode)  # fmt: skip


def _json(content: dict[str, Any], request_id: str) -> JSONResponse:
    return JSONResponse(content, headers={"x-request-id": request_id})


def _chat_chunk(head: dict[str, Any], choice: Choice) -> ChunkBuilder:
    def build(text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text or finish_reason is None else {}
        body = {"index": choice.index, "delta": delta, "logprobs": None}
        body |= _finish(choice, finish_reason)
        return {**head, "object": "chat.completion.chunk", "choices": [body]}

    return build


def _completion_chunk(head: dict[str, Any], choice: Choice) -> ChunkBuilder:
    def build(text: str, finish_reason: str | None) -> dict[str, Any]:
        body = {"index": choice.index, "text": text, "logprobs": None}
        body |= _finish(choice, finish_reason)
        return {**head, "object": "text_completion", "choices": [body]}

    return build


def _finish(choice: Choice, finish_reason: str | None) -> dict[str, Any]:
    """A choice's finish_reason and vLLM's stop_reason (the stop string or token id that
    ended it; null otherwise and until the end)."""
    stop_reason = choice.generation.stop_reason if finish_reason is not None else None
    return {"finish_reason": finish_reason, "stop_reason": stop_reason}


def _sse(streams: list[ChoiceStream], body: SamplingFields, request_id: str) -> SseResponse:
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    formats = [
        ChunkFormat(s.build, include_usage, running_usage(s.choice) if continuous else None)
        for s in streams
    ]
    choices = [stream.choice for stream in streams]
    service = choices[0].generation.service
    keepalive_s = service.settings.sse_keepalive_s or None  # 0: no keep-alives

    async def events() -> AsyncIterator[bytes]:
        try:
            async for event in merged_events(streams, formats, keepalive_s):
                yield event
            if include_usage:
                final = streams[0].build("", None)
                yield formats[0].event({**final, "choices": [], "usage": usage(choices)})
        except APIError as exc:
            exc.request_id = exc.request_id or request_id
            yield error_event(exc)

    def close() -> None:
        for choice in choices:
            service.finish(choice.generation)

    headers = {"x-request-id": request_id, "cache-control": "no-cache"}
    return SseResponse(events(), headers, close)
