"""`/v1`: chat completions, completions (streaming and not) and models, in OpenAI's and vLLM's
shapes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.errors import APIError
from gateway.fastlane import FastRoutes
from gateway.generation import KEEPALIVE, Generation, GenerationParams
from gateway.openai_models import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.sampling import generation_params
from gateway.sse import KEEPALIVE_EVENT, ChunkBuilder, ChunkFormat, SseResponse
from gateway.state import GatewayState
from gateway.tenancy import admit, authenticate
from gateway.tokenize_routes import router as tokenize_router
from gateway.unsupported import reject_unsupported

router = APIRouter()
router.include_router(tokenize_router)  # /tokenize, /detokenize, /version, /ping


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    await authenticate(state, request)
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": int(state.started_s),
                "owned_by": "superinfer",
                "root": state.model_name,
                "max_model_len": state.directory.max_model_len(),
            }
        ],
    }


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request
) -> JSONResponse | SseResponse:
    state = _state(request)
    max_tokens = body.max_completion_tokens or body.max_tokens
    prompt = state.prompts.chat_completion(body)
    generation = await _admit_and_start(state, request, body, prompt, max_tokens, "chatcmpl")
    request_id, created = generation.request_id, int(time.time())
    head = {"id": request_id, "created": created, "model": state.model_name}
    if body.stream:
        return _sse(generation, _chat_chunk(head), body, first={"role": "assistant", "content": ""})
    text_out = await _collect(generation, request)
    message = {"role": "assistant", "content": text_out}
    choice = {"index": 0, "message": message, "logprobs": None}
    choice["finish_reason"] = generation.finish_reason
    return _json(
        {**head, "object": "chat.completion", "choices": [choice], "usage": _usage(generation)},
        request_id,
    )


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | SseResponse:
    state = _state(request)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's and vLLM's default
    prompt = state.prompts.completion(body.prompt)
    generation = await _admit_and_start(state, request, body, prompt, max_tokens, "cmpl")
    request_id = generation.request_id
    head = {"id": request_id, "created": int(time.time()), "model": state.model_name}
    if body.stream:
        return _sse(generation, _completion_chunk(head), body, first=None)
    text_out = await _collect(generation, request)
    choice = {"index": 0, "text": text_out, "logprobs": None}
    choice["finish_reason"] = generation.finish_reason
    return _json(
        {**head, "object": "text_completion", "choices": [choice], "usage": _usage(generation)},
        request_id,
    )


def fast_routes() -> FastRoutes:
    """The routes above for :class:`gateway.fastlane.FastLane`: path -> (body model, endpoint)."""
    return {
        "/v1/chat/completions": (ChatCompletionRequest, chat_completions),
        "/v1/completions": (CompletionRequest, completions),
    }


async def _admit_and_start(
    state: GatewayState,
    request: Request,
    body: SamplingFields,
    prompt: Coroutine[Any, Any, list[int]],
    max_tokens: int | None,
    id_prefix: str,
) -> Generation:
    """Everything before the first token, in order: fields we do not serve, the caller (its
    key before anything costly), the prompt, the parameters, routing and submit. A refusal on
    the way is counted (``superinfer:requests_rejected`` by status) and answered."""
    try:
        try:
            reject_unsupported(body)
            caller = await admit(state, request, body)
        except BaseException:
            prompt.close()  # never awaited: the refusal came first
            raise
        prompt_ids = await prompt
        params = generation_params(state, request, body, caller, prompt_ids, max_tokens)
        return await _start(state, f"{id_prefix}-{uuid.uuid4().hex}", params)
    except APIError as exc:
        state.metrics.rejected.labels(str(exc.status_code)).inc()
        raise


async def _start(state: GatewayState, request_id: str, params: GenerationParams) -> Generation:
    """Submit; an error carries the request id (a 5xx body shows it, the log has the rest)."""
    try:
        return await state.generations.start(request_id, params)
    except APIError as exc:
        exc.request_id = request_id
        raise


# ---- generation -> responses ------------------------------------------------------------


async def _collect(generation: Generation, request: Request) -> str:
    """The whole text; a client that disconnects meanwhile aborts the request."""

    async def consume() -> str:
        return "".join([delta.text async for delta in generation.deltas()])

    task = asyncio.create_task(consume())
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise APIError(400, "client disconnected", code="client_disconnected")
    try:
        return task.result()
    except APIError as exc:
        exc.request_id = generation.request_id
        raise


def _usage(generation: Generation) -> dict[str, int]:
    prompt, completion = generation.num_prompt_tokens, generation.num_completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _json(content: dict[str, Any], request_id: str) -> JSONResponse:
    return JSONResponse(content, headers={"x-request-id": request_id})


def _chat_chunk(head: dict[str, Any]) -> ChunkBuilder:
    def build(text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text or finish_reason is None else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**head, "object": "chat.completion.chunk", "choices": [choice]}

    return build


def _completion_chunk(head: dict[str, Any]) -> ChunkBuilder:
    def build(text: str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**head, "object": "text_completion", "choices": [choice]}

    return build


def _sse(
    generation: Generation,
    build: ChunkBuilder,
    body: SamplingFields,
    first: dict[str, Any] | None,
) -> SseResponse:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunks = ChunkFormat(build, include_usage)
    keepalive_s = generation.service.settings.sse_keepalive_s or None  # 0: no keep-alives

    async def events() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                chunk = build("", None)
                chunk["choices"][0]["delta"] = first
                yield chunks.event(chunk)
            async for delta in generation.deltas(keepalive_s):
                if delta.text or delta.finish_reason:
                    yield chunks.delta(delta.text, delta.finish_reason)
                elif delta is KEEPALIVE:
                    yield KEEPALIVE_EVENT
            if include_usage:
                final = build("", None)
                yield chunks.event({**final, "choices": [], "usage": _usage(generation)})
        except APIError as exc:
            exc.request_id = generation.request_id
            yield f"data: {json.dumps(exc.body())}\n\n".encode()

    headers = {"x-request-id": generation.request_id, "cache-control": "no-cache"}
    return SseResponse(events(), headers, lambda: generation.service.finish(generation))
