"""``/v1/responses``: OpenAI's Responses API (create, streamed or not; retrieve; delete), served
by the chat path (:mod:`gateway.responses`) and stored in Redis (:mod:`gateway.response_store`).

A streamed response sends OpenAI's events: ``response.created``, ``response.in_progress``, the
message item (``output_item.added``, ``content_part.added``, ``output_text.delta``... ``.done``),
each function call item (``function_call_arguments.delta`` / ``.done``), then
``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``); a failure
after the first event is an ``error`` event, then ``response.failed`` (stored like the others).
No ``data: [DONE]`` follows, as OpenAI's."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.admission_routes import admit_and_start, chat_prompt, tool_plan
from gateway.choices import Choice, collect, usage
from gateway.errors import APIError
from gateway.generation import KEEPALIVE
from gateway.logprobs_format import chat_content
from gateway.response_store import Conversation
from gateway.responses import as_responses_error, chat_request, stored_items
from gateway.responses_models import ResponsesRequest, reject_unsupported_response_fields
from gateway.responses_output import (
    call_item,
    event_bytes,
    finished,
    message_item,
    response_head,
    status_of,
)
from gateway.sse import KEEPALIVE_EVENT, SseResponse
from gateway.state import GatewayState
from gateway.tenancy import Caller, authenticate
from gateway.tool_parsers import ToolCall
from gateway.tools import ToolPlan, ToolStream, split_output, template_tools

log = structlog.get_logger(__name__)
router = APIRouter()


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> JSONResponse | SseResponse:
    state = _state(request)
    try:
        return await _create(state, body, request)
    except APIError as exc:
        raise as_responses_error(exc) from None


async def _create(
    state: GatewayState, body: ResponsesRequest, request: Request
) -> JSONResponse | SseResponse:
    try:
        reject_unsupported_response_fields(body)
        caller = await authenticate(state, request)
        store = _stores(state, body)
        conversation = Conversation([], [], None)
        if body.previous_response_id is not None:
            conversation = await state.responses.history(body.previous_response_id, caller.key_id)
        chat = chat_request(body, conversation.items)
    except APIError as exc:
        state.metrics.rejected.labels(str(exc.status_code)).inc()
        raise
    plan = tool_plan(state, chat)
    tools = template_tools(chat) if plan.render else None
    prompts = chat_prompt(state, chat, tools)
    (choice,) = await admit_and_start(
        state, request, chat, prompts, chat.max_completion_tokens, "resp_", plan.structured,
        prefer_worker=conversation.worker_id, caller=caller,
    )  # fmt: skip
    head = response_head(body, choice.generation.request_id, int(time.time()))
    head |= {"model": state.model_name, "store": store}
    saver = _Saver(state, body, caller, choice, conversation if store else None)
    if body.stream:
        return _streamed(state, choice, plan, head, saver, bool(chat.logprobs))
    await collect([choice], request)
    content, calls = split_output(plan, choice.text, choice.generation.finish_reason)
    reason = choice.generation.finish_reason
    reason = "tool_calls" if calls and reason != "length" else reason
    status = status_of(reason)
    logprobs = choice.chat_logprobs(state.prompts.token_names)["content"] if chat.logprobs else None
    output = [message_item(content, logprobs, status)] if content or not calls else []
    output += [call_item(call, choice.generation.finish_reason) for call in calls]
    response = finished(head, output, reason, usage([choice]))
    await saver.save(response)
    return JSONResponse(response, headers={"x-request-id": response["id"]})


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    caller = await authenticate(state, request)
    record = await state.responses.load(response_id, caller.key_id)
    response: dict[str, Any] = record["response"]
    return response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    caller = await authenticate(state, request)
    await state.responses.delete(response_id, caller.key_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _stores(state: GatewayState, body: ResponsesRequest) -> bool:
    """Whether this response is stored: ``store`` (default true, as OpenAI's) where the server
    keeps responses; asking for storing, or continuing, where it keeps none is a 400."""
    if state.responses.enabled:
        return body.store is not False
    asked = {"store": body.store, "previous_response_id": body.previous_response_id}
    for param, value in asked.items():
        if value:
            raise APIError(400, "this server stores no responses (responses_ttl_s 0)", param)
    return False


async def _failed(
    emit: _Events, exc: APIError, head: dict[str, Any], output: list[Any], saver: _Saver
) -> list[bytes]:
    """The events of a generation that failed after the stream began: ``error`` (with our
    code), then ``response.failed`` with the response as it got (stored, when stored at all;
    its error's code OpenAI's ``server_error``, the one of its codes a server failure has)."""
    exc.request_id = head["id"]
    error = exc.body()["error"]
    failed = {**head, "status": "failed", "output": output, "usage": None}
    failed["error"] = {"code": "server_error", "message": error["message"]}
    await saver.save_or_log(failed)
    return [
        emit("error", code=error["code"], message=error["message"], param=error["param"]),
        emit("response.failed", response=failed),
    ]


class _Saver:
    """Stores the response once it ended, with the chain it continues (None: not stored)."""

    def __init__(
        self,
        state: GatewayState,
        body: ResponsesRequest,
        caller: Caller,
        choice: Choice,
        continued: Conversation | None,
    ) -> None:
        """``continued``: the conversation the response continues (an empty one for a first
        turn); None when the response is not stored."""
        self.state, self.body, self.caller = state, body, caller
        self.choice, self.continued = choice, continued

    async def save(self, response: dict[str, Any]) -> None:
        continued = self.continued
        if continued is None:
            return
        worker_id = self.choice.generation.record.route.worker_id
        await self.state.responses.save(
            response, stored_items(self.body), self.caller.key_id, worker_id,
            continued.response_ids, continued.num_bytes,
        )  # fmt: skip

    async def save_or_log(self, response: dict[str, Any]) -> None:
        """:meth:`save` for a stream that already sent the output: Redis refusing it is logged
        (a later ``previous_response_id`` then finds nothing), never a failed response."""
        try:
            await self.save(response)
        except APIError as exc:
            log.warning("response_not_stored", response_id=response["id"], error=exc.message)


class _Events:
    """Each event with its ``sequence_number``."""

    def __init__(self) -> None:
        self.num_sent = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.num_sent, **fields}
        self.num_sent += 1
        return event_bytes(event)


def _streamed(
    state: GatewayState,
    choice: Choice,
    plan: ToolPlan,
    head: dict[str, Any],
    saver: _Saver,
    with_logprobs: bool,
) -> SseResponse:
    service = choice.generation.service
    keepalive_s = service.settings.sse_keepalive_s or None
    emit = _Events()
    stream = _MessageStream(emit, state, with_logprobs)

    async def events() -> AsyncIterator[bytes]:
        try:
            started = {**head, "status": "in_progress", "output": [], "usage": None}
            yield emit("response.created", response=started)
            yield emit("response.in_progress", response=started)
            tools = ToolStream(plan) if plan.calls_tools else None
            async for delta in choice.generation.deltas(keepalive_s):
                if delta is KEEPALIVE:
                    yield KEEPALIVE_EVENT
                    continue
                choice.deltas.append(delta)
                text = tools.feed(delta.text) if tools is not None else delta.text
                calls: list[ToolCall] = []
                if delta.finish_reason and tools is not None:
                    rest, calls = tools.finish(delta.finish_reason)
                    text += rest
                for event in stream.text(text, delta.token_ids, delta.logprobs):
                    yield event
                if delta.finish_reason:
                    reason = delta.finish_reason
                    reason = "tool_calls" if calls and reason != "length" else reason
                    for event in stream.finish(reason, calls, delta.finish_reason):
                        yield event
                    response = finished(head, stream.output, reason, usage([choice]))
                    await saver.save_or_log(response)  # what was generated is sent anyway
                    yield emit(f"response.{response['status']}", response=response)
        except APIError as exc:
            for event in await _failed(emit, exc, head, stream.output_so_far(), saver):
                yield event

    def close() -> None:
        service.finish(choice.generation)

    headers = {"x-request-id": head["id"], "cache-control": "no-cache"}
    return SseResponse(events(), headers, close, done=None)  # OpenAI's Responses end unmarked


class _MessageStream:
    """The output items of one streamed response as events: the message opened at its first
    text, closed at the end (an empty one when nothing else came), then the calls."""

    def __init__(self, emit: _Events, state: GatewayState, with_logprobs: bool) -> None:
        self.emit = emit
        self.names = state.prompts.token_names
        self.with_logprobs = with_logprobs
        self.message: dict[str, Any] | None = None
        self.closed = False  # the message's done events were sent
        self.text_so_far = ""
        self.pending: list[Any] = []  # log-probabilities of tokens whose text is held
        self.logprobs: list[Any] = []
        self.output: list[dict[str, Any]] = []

    def _where(self) -> dict[str, Any]:
        assert self.message is not None
        return {"item_id": self.message["id"], "output_index": 0, "content_index": 0}

    def _open(self) -> list[bytes]:
        self.message = message_item("", [] if self.with_logprobs else None, "in_progress")
        self.message["content"] = []
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self.emit("response.output_item.added", output_index=0, item=self.message),
            self.emit("response.content_part.added", **self._where(), part=part),
        ]

    def text(self, text: str, token_ids: tuple[int, ...], logprobs: Any) -> list[bytes]:
        if self.with_logprobs and logprobs is not None:
            self.pending.extend(chat_content(token_ids, logprobs, self.names))
        if not text:
            return []
        events = self._open() if self.message is None else []
        entries, self.pending = self.pending, []
        self.logprobs.extend(entries)
        self.text_so_far += text
        fields: dict[str, Any] = {"delta": text, "logprobs": entries}
        events.append(self.emit("response.output_text.delta", **self._where(), **fields))
        return events

    def output_so_far(self) -> list[dict[str, Any]]:
        """The items done, then the message still open (``incomplete``, its text so far):
        what a failed response keeps."""
        if self.message is None or self.closed:
            return list(self.output)
        logprobs = self.logprobs if self.with_logprobs else None
        item = message_item(self.text_so_far, logprobs, "incomplete")
        item["id"] = self.message["id"]
        return [*self.output, item]

    def finish(
        self, reason: str, calls: list[ToolCall], finish_reason: str | None = None
    ) -> list[bytes]:
        """The closing events (``finish_reason``: the generation's, which cut a call when
        ``length``)."""
        events = self._open() if self.message is None and not calls else []
        if self.message is not None:
            status = status_of(reason)
            if self.pending:  # tokens with no text (the end of turn): their delta, empty
                fields: dict[str, Any] = {"delta": "", "logprobs": self.pending}
                events.append(self.emit("response.output_text.delta", **self._where(), **fields))
                self.logprobs.extend(self.pending)
                self.pending = []
            self.closed = True
            logprobs = self.logprobs if self.with_logprobs else None
            item = message_item(self.text_so_far, logprobs, status)
            item["id"] = self.message["id"]
            text, part = self.text_so_far, item["content"][0]
            done = {"text": text, "logprobs": self.logprobs if self.with_logprobs else []}
            events.append(self.emit("response.output_text.done", **self._where(), **done))
            events.append(self.emit("response.content_part.done", **self._where(), part=part))
            events.append(self.emit("response.output_item.done", output_index=0, item=item))
            self.output.append(item)
        for call in calls:
            events.extend(self._call(call, finish_reason))
        return events

    def _call(self, call: ToolCall, finish_reason: str | None) -> list[bytes]:
        index = len(self.output)
        item = call_item(call, finish_reason)
        where = {"item_id": item["id"], "output_index": index}
        opened = {**item, "arguments": "", "status": "in_progress"}
        return [
            self.emit("response.output_item.added", output_index=index, item=opened),
            self.emit("response.function_call_arguments.delta", **where, delta=call.arguments),
            self.emit("response.function_call_arguments.done", **where, arguments=call.arguments),
            self._done(index, item),
        ]

    def _done(self, index: int, item: dict[str, Any]) -> bytes:
        self.output.append(item)
        return self.emit("response.output_item.done", output_index=index, item=item)
