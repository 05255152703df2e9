"""Everything a chat or completion request goes through before its first token: the fields
served, the caller, the prompts, the parameters, routing and submit of each choice (``n`` x
prompts), owned until the route hands them on."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import replace
from typing import Any

from fastapi import Request

from gateway.choices import (
    DISCONNECT_POLL_S,
    Choice,
)
from gateway.errors import APIError
from gateway.generation import Generation, GenerationParams
from gateway.openai_models import ChatCompletionRequest, SamplingFields
from gateway.sampling import check_choices, generation_params, refuse_uncompilable
from gateway.state import GatewayState
from gateway.tenancy import Caller, admit
from gateway.tools import ToolPlan, plan_tools
from gateway.unsupported import reject_unsupported
from shared.sampling import StructuredOutput


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
    with owned(state, choices):  # each choice owned from its submit on
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
def owned(state: GatewayState, choices: list[Choice]) -> Iterator[None]:
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
