"""Server-sent events for one generation: chunks serialised from a template made once per
response, and a lean ASGI response that streams them.

Every chunk of a response has the same id, model and shape; only its text and finish reason
change. :class:`ChunkFormat` serialises the whole chunk once with two markers, cuts the JSON
at them, and afterwards only escapes the text: the bytes are those ``json.dumps`` gives for the
whole chunk (ASCII-only JSON, so no U+2028, U+0085... that line-splitting clients cut at).

:class:`SseResponse` does what Starlette's StreamingResponse does (headers at once, each event
as it comes, the stream cancelled when the client disconnects) with one watcher task instead
of an anyio task group per response, and ends its generation whatever happens."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping
from json.encoder import encode_basestring_ascii
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

ChunkBuilder = Callable[[str, str | None], dict[str, Any]]
DONE = b"data: [DONE]\n\n"
KEEPALIVE_EVENT = b": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see traffic
_TEXT_MARK, _REASON_MARK = "\x00text\x00", "\x00finish_reason\x00"


class ChunkFormat:
    """``data: <chunk JSON>\\n\\n`` for the chunks ``build`` makes; when the client asked for
    usage, each chunk has ``"usage"``: null, or ``running_usage()`` when given (vLLM's
    ``continuous_usage_stats``)."""

    def __init__(
        self,
        build: ChunkBuilder,
        include_usage: bool,
        running_usage: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self._build = build
        self._include_usage = include_usage
        self._running_usage = running_usage if include_usage else None
        probe = self.event(build(_TEXT_MARK, _REASON_MARK)).decode()
        head, rest = probe.split(json.dumps(_TEXT_MARK))
        middle, tail = rest.split(json.dumps(_REASON_MARK))
        self._head, self._middle, self._tail = head, middle, tail

    def event(self, chunk: dict[str, Any]) -> bytes:
        """Any chunk, serialised in full."""
        if self._include_usage and "usage" not in chunk:
            chunk["usage"] = None if self._running_usage is None else self._running_usage()
        return f"data: {json.dumps(chunk)}\n\n".encode()

    def delta(self, text: str, finish_reason: str | None) -> bytes:
        """The chunk of one text delta, the same bytes as ``event(build(text, reason))``."""
        if finish_reason is not None or self._running_usage is not None:
            # built whole: the last (its stop_reason, a chat's delta), or with running usage
            return self.event(self._build(text, finish_reason))
        reason = "null" if finish_reason is None else encode_basestring_ascii(finish_reason)
        parts = (self._head, encode_basestring_ascii(text), self._middle, reason, self._tail)
        return "".join(parts).encode()


class SseResponse(Response):
    """``events`` as a text/event-stream response, then ``done`` (``data: [DONE]``; None:
    nothing) in the same write as the end of the body; ``on_close`` runs when it ends for any
    reason, also when the client left before the first byte (the event generator then never
    started, so its own cleanup never ran)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: Mapping[str, str],
        on_close: Callable[[], None],
        done: bytes | None = DONE,
    ) -> None:
        self.status_code = 200
        self._done = done or b""
        self.background = None
        self.init_headers(headers)
        self._events = events
        self._on_close = on_close
        self._streaming = False
        self._disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._streaming = True
        watcher = asyncio.ensure_future(self._cancel_on_disconnect(receive, task))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self._events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": self._done, "more_body": False})
        except asyncio.CancelledError:
            if not self._disconnected or task.uncancel() > 0:
                raise  # cancelled from outside (shutdown), not by our own watcher
        finally:
            self._streaming = False  # no await since the last send: the watcher cancels no more
            watcher.cancel()
            self._on_close()

    async def _cancel_on_disconnect(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        """Wait for the client to go away, then cancel the stream (it may be waiting for the
        worker's next token for a long time)."""
        with contextlib.suppress(Exception):  # a broken receive counts as a disconnect
            while (await receive())["type"] != "http.disconnect":
                pass
        if self._streaming:
            self._disconnected = True
            task.cancel()
