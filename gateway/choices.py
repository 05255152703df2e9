"""The choices of one response: each a :class:`Generation` (a prompt of a batch, or one of
``n`` samples), collected whole or streamed as one SSE stream whose chunks name their choice's
index; with their text, the log-probabilities asked for and, for completions, the echoed
prompt.

Chunks of different choices interleave as their tokens come (OpenAI's and vLLM's order); each
choice's finish reason is its own chunk's. Usage counts each distinct prompt once and every
choice's completion tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request

from gateway.errors import APIError
from gateway.generation import KEEPALIVE, Delta, Generation
from gateway.logprobs_format import CompletionLogprobs, Decode, TokenNames, chat_content
from gateway.sse import KEEPALIVE_EVENT, ChunkBuilder, ChunkFormat
from gateway.tools import ToolStream, calls_finish_reason

_DONE = object()  # a choice's stream ended


@dataclass(slots=True)
class Choice:
    """One choice: its index in the response, its generation and what it returns besides
    the generated text (``echo``: the prompt's text first; ``echo_only``: nothing else, the
    worker's one token dropped: max_tokens 0)."""

    index: int
    generation: Generation
    echo: str | None = None
    echo_only: bool = False
    deltas: list[Delta] = field(default_factory=list)

    @property
    def text(self) -> str:
        generated = "" if self.echo_only else "".join(d.text for d in self.deltas)
        return (self.echo or "") + generated

    def completion_logprobs(self, decode: Decode) -> dict[str, Any]:
        """The completions ``logprobs`` object: the echoed prompt's positions, then the
        generated tokens'."""
        logprobs = CompletionLogprobs(decode)
        self.echo_logprobs(logprobs)
        if not self.echo_only:
            for delta in self.deltas:
                if delta.logprobs is not None:
                    logprobs.add(delta.token_ids, delta.logprobs)
        return logprobs.take()

    def echo_logprobs(self, logprobs: CompletionLogprobs) -> None:
        """The echoed prompt's positions (the first has no log-probability)."""
        generation = self.generation
        if self.echo is None or generation.params.sampling.logprobs is None:
            return
        prompt_ids = generation.params.prompt_token_ids
        logprobs.add_first(prompt_ids[0])
        if generation.prompt_logprobs is not None:  # computed for max(N, prompt_logprobs)
            num_top = generation.params.sampling.logprobs
            logprobs.add(prompt_ids[1:], generation.prompt_logprobs, num_top)

    def chat_logprobs(self, names: TokenNames) -> dict[str, Any]:
        content = [
            entry
            for delta in self.deltas
            if delta.logprobs is not None
            for entry in chat_content(delta.token_ids, delta.logprobs, names)
        ]
        return {"content": content}


def usage(choices: list[Choice]) -> dict[str, Any]:
    """Each distinct prompt once (``n`` choices share theirs; its cached tokens are its first
    choice's, the one that found what the others then share), every choice's completion;
    ``prompt_tokens_details.cached_tokens``: prompt tokens the worker's prefix cache served."""
    prompts: dict[int, tuple[int, int]] = {}
    for choice in choices:
        generation = choice.generation
        key = id(generation.params.prompt_token_ids)
        if key not in prompts:
            prompts[key] = (generation.num_prompt_tokens, generation.num_cached_tokens)
    prompt = sum(n for n, _ in prompts.values())
    completion = sum(0 if c.echo_only else c.generation.num_completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c for _, c in prompts.values())},
    }


def running_usage(choice: Choice) -> Callable[[], dict[str, Any]]:
    """One choice's usage so far (vLLM's ``continuous_usage_stats``: its prompt and the
    tokens it has produced)."""
    generation = choice.generation

    def now() -> dict[str, Any]:
        completion = 0 if choice.echo_only else generation.num_completion_tokens
        prompt = generation.num_prompt_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    return now


DISCONNECT_POLL_S = 0.5  # how often a wait with no stream to write to asks for the client


async def collect(choices: list[Choice], request: Request) -> None:
    """Every choice's deltas; a client that disconnects meanwhile aborts them all."""

    async def consume(choice: Choice) -> None:
        choice.deltas = [delta async for delta in choice.generation.deltas()]

    tasks = [asyncio.create_task(consume(choice)) for choice in choices]
    try:
        while not all(task.done() for task in tasks):
            await asyncio.wait(
                tasks, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_EXCEPTION
            )
            if any(t.done() and t.exception() is not None for t in tasks):
                break
            if not all(t.done() for t in tasks) and await request.is_disconnected():
                raise APIError(400, "client disconnected", code="client_disconnected")
        for choice, task in zip(choices, tasks, strict=True):
            if task.done() and task.exception() is not None:
                exc = task.exception()
                if isinstance(exc, APIError):
                    exc.request_id = choice.generation.request_id
                raise exc  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class ChunkLogprobs(Protocol):
    """What a streamed chunk's ``logprobs`` holds: the positions since the previous chunk (a
    delta whose text the detokenizer holds back sends its log-probabilities with the next
    text)."""

    def echo(self, choice: Choice) -> Any:
        """The echo chunk's, with the prompt's positions."""

    def __call__(self, delta: Delta) -> Any:
        """The chunk's for ``delta`` (None: held for the next chunk)."""


class CompletionChunkLogprobs:
    """Completions' streamed ``logprobs`` (text offsets run on over the whole choice)."""

    def __init__(self, decode: Decode) -> None:
        self.logprobs = CompletionLogprobs(decode)

    def echo(self, choice: Choice) -> Any:
        choice.echo_logprobs(self.logprobs)
        return self.logprobs.take()

    def __call__(self, delta: Delta) -> Any:
        if delta.logprobs is not None:
            self.logprobs.add(delta.token_ids, delta.logprobs)
        return self.logprobs.take() if delta.text or delta.finish_reason else None


class ChatChunkLogprobs:
    """Chat's streamed ``logprobs``: ``{"content": [...]}``."""

    def __init__(self, names: TokenNames) -> None:
        self.names = names
        self.pending: list[dict[str, Any]] = []

    def echo(self, choice: Choice) -> Any:
        return None  # chat has no echo

    def __call__(self, delta: Delta) -> Any:
        if delta.logprobs is not None:
            self.pending.extend(chat_content(delta.token_ids, delta.logprobs, self.names))
        if not (delta.text or delta.finish_reason):
            return None
        content, self.pending = self.pending, []
        return {"content": content}


@dataclass(slots=True)
class ChoiceStream:
    """How one choice streams: its chunk builder (its index in it), its first chunk's delta
    (chat: the role) and its chunks' log-probabilities, when asked for."""

    choice: Choice
    build: ChunkBuilder
    first: dict[str, Any] | None = None
    chunk_logprobs: ChunkLogprobs | None = None
    tools: ToolStream | None = None  # chat under a tool plan: calls held, then sent whole

    async def events(self, chunks: ChunkFormat, keepalive_s: float | None) -> AsyncIterator[bytes]:
        if self.first is not None:
            chunk = self.build("", None)
            chunk["choices"][0]["delta"] = self.first
            yield chunks.event(chunk)
        echoed = self.choice.echo is None
        async for delta in self.choice.generation.deltas(keepalive_s):
            if delta is KEEPALIVE:
                yield KEEPALIVE_EVENT
                continue
            self.choice.deltas.append(delta)
            if not echoed:  # after the first output: the prompt's log-probabilities are in
                echoed = True
                yield self._chunk(chunks, self.choice.echo or "", None, self._echo_logprobs())
            if self.choice.echo_only:
                if delta.finish_reason:
                    yield chunks.delta("", delta.finish_reason)
                continue
            logprobs = None if self.chunk_logprobs is None else self.chunk_logprobs(delta)
            if self.tools is not None:
                for event in self._tool_events(chunks, delta, logprobs):
                    yield event
            elif delta.text or delta.finish_reason:
                yield self._chunk(chunks, delta.text, delta.finish_reason, logprobs)

    def _tool_events(self, chunks: ChunkFormat, delta: Delta, logprobs: Any) -> list[bytes]:
        """Content as the tool stream releases it; at the end the held rest, the calls as
        one ``tool_calls`` delta, and the finish (``tool_calls`` when there were calls)."""
        assert self.tools is not None
        text = self.tools.feed(delta.text)
        if not delta.finish_reason:
            return [self._chunk(chunks, text, None, logprobs)] if text or logprobs else []
        rest, calls = self.tools.finish(delta.finish_reason)
        events = []
        if text + rest or logprobs:
            events.append(self._chunk(chunks, text + rest, None, logprobs))
        if calls:
            chunk = self.build("", None)
            chunk["choices"][0]["delta"] = {
                "tool_calls": [call.as_openai(i) for i, call in enumerate(calls)]
            }
            events.append(chunks.event(chunk))
        reason = calls_finish_reason(self.tools.plan, delta.finish_reason)
        events.append(chunks.delta("", reason if calls else delta.finish_reason))
        return events

    def _echo_logprobs(self) -> Any:
        return None if self.chunk_logprobs is None else self.chunk_logprobs.echo(self.choice)

    def _chunk(self, chunks: ChunkFormat, text: str, reason: str | None, logprobs: Any) -> bytes:
        if logprobs is None:
            return chunks.delta(text, reason)
        chunk = self.build(text, reason)
        chunk["choices"][0]["logprobs"] = logprobs
        return chunks.event(chunk)


async def merged_events(
    streams: list[ChoiceStream],
    chunk_formats: list[ChunkFormat],
    keepalive_s: float | None,
) -> AsyncIterator[bytes]:
    """Every choice's events as they come (one choice: its own, no tasks), through a queue of
    one event per choice. A choice's error ends the response with its error event; the others
    are cancelled (and so aborted)."""
    if len(streams) == 1:
        async for event in streams[0].events(chunk_formats[0], keepalive_s):
            yield event
        return
    # Events held here are bounded (``room``): a client that stops reading stops the pumps,
    # so each choice's own bounded outputs fill and overflow as a single stream's do (its
    # request ended, not buffered here). An end or an error never waits for room.
    queue: asyncio.Queue[Any] = asyncio.Queue()
    room = asyncio.Semaphore(len(streams))

    async def pump(stream: ChoiceStream, chunks: ChunkFormat) -> None:
        try:
            async for event in stream.events(chunks, keepalive_s):
                await room.acquire()
                queue.put_nowait(event)
        except APIError as exc:
            exc.request_id = stream.choice.generation.request_id
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(s, f)) for s, f in zip(streams, chunk_formats, strict=True)]
    try:
        num_open = len(tasks)
        while num_open:
            item = await queue.get()
            if item is _DONE:
                num_open -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                room.release()
                yield item
    finally:
        for task in tasks:
            task.cancel()


def error_event(exc: APIError) -> bytes:
    return f"data: {json.dumps(exc.body())}\n\n".encode()
