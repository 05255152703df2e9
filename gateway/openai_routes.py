"""`/v1`: chat completions, completions (streaming and not) and models, in OpenAI's and vLLM's
shapes."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.choices import (
    DISCONNECT_POLL_S,
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
from gateway.generation import Generation, GenerationParams
from gateway.logprobs_format import Decode, vllm_prompt_logprobs
from gateway.openai_models import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.sampling import check_choices, generation_params, refuse_uncompilable
from gateway.sse import ChunkBuilder, ChunkFormat, SseResponse
from gateway.state import GatewayState
from gateway.tenancy import Caller, admit, authenticate
from gateway.tokenize_routes import router as tokenize_router
from gateway.tools import ToolPlan, ToolStream, assistant_message, plan_tools, template_tools
from gateway.unsupported import reject_unsupported
from shared.sampling import StructuredOutput

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
    choices = await admit_and_start(state, request, body, prompts, max(1, max_tokens), "cmpl-")
    request_id, decode = _response_id(choices), state.prompts.token_text
    if body.echo:
        with _owned(state, choices):
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


def tool_plan(state: GatewayState, body: ChatCompletionRequest) -> ToolPlan:
    """The request's tool plan (a refusal counted like the others)."""
    settings = state.settings
    try:
        return plan_tools(
            body,
            settings.enable_auto_tool_choice,
            settings.tool_call_parser,
            settings.exclude_tools_when_tool_choice_none,
        )
    except APIError as exc:
        state.metrics.rejected.labels(str(exc.status_code)).inc()
        raise


async def chat_prompt(
    state: GatewayState, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None
) -> list[list[int]]:
    """The chat's one prompt (rendered when awaited: a refusal before then renders nothing)."""
    return [await state.prompts.chat_completion(body, tools)]


async def admit_and_start(
    state: GatewayState,
    request: Request,
    body: SamplingFields,
    prompts: Coroutine[Any, Any, list[list[int]]],
    max_tokens: int | None,
    id_prefix: str,
    tool_structured: StructuredOutput | None = None,
    prefer_worker: str | None = None,
    caller: Caller | None = None,
) -> list[Choice]:
    """Everything before the first token, in order: fields we do not serve, the caller (its
    key before anything costly, unless the route gives it), the prompts, the parameters,
    routing (to ``prefer_worker`` where it can take the request, else by ``prompt_cache_key``'s
    worker, else the least lagging) and submit. A refusal on the way is counted
    (``superinfer:requests_rejected`` by status) and answered."""
    try:
        try:
            reject_unsupported(body)
            check_choices(body)
            caller = await admit(state, request, body, caller)
        except BaseException:
            prompts.close()  # never awaited: the refusal came first
            raise
        prompt_ids = await prompts
        n = body.n or 1
        if len(prompt_ids) * n > state.settings.max_choices:
            raise APIError(
                400,
                f"{len(prompt_ids)} prompts x n = {n} is over this server's "
                f"{state.settings.max_choices} choices a request",
                param="n" if n > 1 else "prompt",
            )
        params = [
            generation_params(state, request, body, caller, p, max_tokens, tool_structured)
            for p in prompt_ids
        ]
        structured = params[0].sampling.structured
        await refuse_uncompilable(state, body, structured, tool_structured is not None)
        request_id = f"{id_prefix}{uuid.uuid4().hex}"
        if prefer_worker is None and body.prompt_cache_key is not None:
            prefer_worker = state.directory.worker_for_key(body.prompt_cache_key)
        return await _start_choices(state, request, request_id, params, n, prefer_worker)
    except APIError as exc:
        state.metrics.rejected.labels(str(exc.status_code)).inc()
        raise


async def _start_choices(
    state: GatewayState,
    request: Request,
    request_id: str,
    params: list[GenerationParams],
    n: int,
    prefer_worker: str | None = None,
) -> list[Choice]:
    """One generation per prompt and sample. With ``n`` > 1, a prompt's first sample runs
    alone until its first output, then its siblings go to the same worker, whose prefix cache
    then holds the prompt: one prefill (the last partial block aside). A sibling's seed is the
    request's plus its sample number, so the samples differ and repeat with the seed. A
    refusal or a disconnect on the way ends every choice already submitted."""
    choices: list[Choice] = []
    num_choices = len(params) * n
    with _owned(state, choices):  # each choice owned from its submit on
        for i, p in enumerate(params):
            choice_id = _choice_id(request_id, i * n, num_choices)
            first = await _start(state, choice_id, p, prefer_worker)
            choices.append(Choice(i * n, first))
        if n == 1:
            return choices
        firsts = list(choices)
        await _first_outputs(firsts, request)
        for i, (first_choice, p) in enumerate(zip(firsts, params, strict=True)):
            worker_id = first_choice.generation.record.route.worker_id
            for j in range(1, n):
                seed = None if p.sampling.seed is None else p.sampling.seed + j
                t_arr_s = first_choice.generation.timeline.t_arr_s  # the client's arrival
                sibling = replace(p, sampling=replace(p.sampling, seed=seed), t_arr_s=t_arr_s)
                index = i * n + j
                generation = await _start(
                    state, _choice_id(request_id, index, num_choices), sibling, worker_id
                )
                choices.append(Choice(index, generation))
        return sorted(choices, key=lambda c: c.index)


@contextlib.contextmanager
def _owned(state: GatewayState, choices: list[Choice]) -> Iterator[None]:
    """Until the response takes them over: an exception ends every choice in ``choices``
    (as it is then), so nothing submitted outlives a refused request."""
    try:
        yield
    except BaseException:
        for choice in choices:
            state.generations.finish(choice.generation)  # aborts what was submitted
        raise


async def _first_outputs(firsts: list[Choice], request: Request) -> None:
    """Wait for every first sample's first output (its prompt is then in the worker's prefix
    cache); a client that leaves meanwhile is a 400 (its choices are ended by the caller)."""
    waiting = asyncio.ensure_future(
        asyncio.gather(*(c.generation.wait_first_output() for c in firsts))
    )
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
            if done:
                waiting.result()  # its error, if any
                return
            if await request.is_disconnected():
                raise APIError(400, "client disconnected", code="client_disconnected")
    finally:
        waiting.cancel()


def _response_id(choices: list[Choice]) -> str:
    """The response's id: its one choice's, or what every choice's id starts with."""
    first = choices[0].generation.request_id
    return first if len(choices) == 1 else first.removesuffix("-0")


def _choice_id(request_id: str, index: int, num_choices: int) -> str:
    """The wire id of choice ``index`` (the response's id alone for a single choice)."""
    return request_id if num_choices == 1 else f"{request_id}-{index}"


async def _start(
    state: GatewayState, request_id: str, params: GenerationParams, worker_id: str | None = None
) -> Generation:
    """Submit; an error carries the request id (a 5xx body shows it, the log has the rest)."""
    try:
        return await state.generations.start(request_id, params, worker_id)
    except APIError as exc:
        exc.request_id = request_id
        raise


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
