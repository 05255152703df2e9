"""The HTTP edge: uvicorn's h11 protocol with every limit enforced before the app sees a byte.

- The request head (request line + headers) is at most ``http_max_head_bytes``: h11 refuses a
  longer one as it arrives (its receive buffer is searched linearly, never rescanned), answered
  431, or 414 when the request line alone is that long; a URL over ``http_max_url_bytes`` is
  414 and more than ``http_max_headers`` headers 431; a malformed head 400.
- The head must arrive within ``http_header_timeout_s`` of the connection (or of its first byte
  on a kept-alive connection): after that a connection that sent nothing is closed, one that
  sent part of a head gets 408. A body must arrive within ``http_body_timeout_s`` of its head:
  408. Between requests a connection stays open ``http_keep_alive_s``.
- At most ``http_max_connections`` connections are open (streams included): beyond it the
  oldest connection waiting for a head is closed to make room, and when every open connection
  is serving a request the new one gets 503 ``too_many_connections`` and is closed.

uvicorn's httptools protocol cannot be bounded (it concatenates the URL and header fragments
without a cap: quadratic), so the gateway always runs this one. A refusal is written, the
connection half-closed and the client's remaining bytes discarded for ``LINGER_S`` before the
close, so that a client still sending its oversized head reads the status instead of a reset.
"""

from __future__ import annotations

import http
import json
import resource
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.errors import error_body
from gateway.settings import GatewaySettings

log = structlog.get_logger(__name__)

LINGER_S = 1.0  # how long a refused client's remaining bytes are read and dropped
MAX_LINGERING = 256  # refusals lingering at once; beyond, a refused connection closes at once
FD_RESERVE = 256  # open files kept for everything but client connections (Redis, logs, ...)


@dataclass(frozen=True)
class EdgeLimits:
    max_head_bytes: int
    max_url_bytes: int
    max_headers: int
    header_timeout_s: float
    body_timeout_s: float
    keep_alive_s: float
    max_connections: int

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> EdgeLimits:
        """The limits, ``http_max_connections`` kept below the process's open-file limit."""
        return cls(
            max_head_bytes=settings.http_max_head_bytes,
            max_url_bytes=settings.http_max_url_bytes,
            max_headers=settings.http_max_headers,
            header_timeout_s=settings.http_header_timeout_s,
            body_timeout_s=settings.http_body_timeout_s,
            keep_alive_s=settings.http_keep_alive_s,
            max_connections=_within_open_files(settings.http_max_connections),
        )


def _within_open_files(max_connections: int) -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or max_connections + FD_RESERVE <= soft:
        return max_connections
    lowered = max(soft - FD_RESERVE, 1)
    log.warning(
        "http_max_connections_lowered", configured=max_connections, used=lowered, open_files=soft
    )
    return lowered


class _Shared:
    """What the connections of one server share."""

    def __init__(self) -> None:
        self.waiting: OrderedDict[EdgeProtocol, None] = OrderedDict()  # for a head, oldest first
        self.lingering = 0


def edge_protocol(limits: EdgeLimits) -> type[H11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` (one per server)."""
    namespace = {"limits": limits, "shared": _Shared()}
    return type("EdgeProtocol", (EdgeProtocol,), namespace)


def refusal(status: int, message: str, code: str) -> bytes:
    """A complete ``connection: close`` response in OpenAI's error shape."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class EdgeProtocol(H11Protocol):
    limits: ClassVar[EdgeLimits]
    shared: ClassVar[_Shared]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.limits.keep_alive_s  # type: ignore[assignment]
        self._asgi_app = self.app
        self.app = self._edge_app
        self._head_timer: Any = None
        self._body_timer: Any = None
        self._lingering = False

    def connection_made(self, transport: Any) -> None:
        if len(self.connections) >= self.limits.max_connections and not self._make_room():
            self.transport = transport
            log.warning("http_connection_refused", open=len(self.connections))
            message = f"more than {self.limits.max_connections} open connections; retry later"
            self._refuse(refusal(503, message, "too_many_connections"))
            return
        super().connection_made(transport)
        self._await_head()

    def _make_room(self) -> bool:
        """Close the oldest connection waiting for a head; False when none is."""
        while self.shared.waiting:
            oldest, _ = self.shared.waiting.popitem(last=False)
            if not oldest.transport.is_closing():
                oldest._cancel_timers()
                oldest.transport.close()
                return True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        self.shared.waiting.pop(self, None)
        if self._lingering:
            self.shared.lingering -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # a refused client's remaining bytes
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._await_head()  # the first byte after a keep-alive wait
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self._lingering or self.conn.their_state is h11.IDLE:
            return
        self.shared.waiting.pop(self, None)
        if self._head_timer is not None:  # the head is complete
            self._head_timer.cancel()
            self._head_timer = None
        if self.conn.their_state is h11.SEND_BODY and self._body_timer is None:
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_late)
        elif self.conn.their_state is not h11.SEND_BODY and self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.shared.waiting[self] = None  # kept alive: the first to go when room is needed

    def send_400_response(self, msg: str) -> None:
        """h11 refused the head: too long (431, 414 for the request line) or malformed."""
        buffered, _ = self.conn.trailing_data
        if len(buffered) <= self.limits.max_head_bytes:
            self._refuse(refusal(400, "invalid HTTP request", "bad_request"))
        elif b"\n" not in buffered:
            message = f"request line over {self.limits.max_head_bytes} bytes"
            self._refuse(refusal(414, message, "uri_too_long"))
        else:
            message = f"request head over {self.limits.max_head_bytes} bytes"
            self._refuse(refusal(431, message, "request_header_fields_too_large"))

    async def _edge_app(self, scope: Any, receive: Any, send: Any) -> None:
        """The URL, header-count and head-size limits, before the gateway's app."""
        url_bytes = len(scope["raw_path"]) + len(scope["query_string"])
        headers = scope["headers"]
        if url_bytes > self.limits.max_url_bytes:
            status, code = 414, "uri_too_long"
            message = f"URL over {self.limits.max_url_bytes} bytes"
        elif len(headers) > self.limits.max_headers:
            status, code = 431, "request_header_fields_too_large"
            message = f"more than {self.limits.max_headers} headers"
        elif url_bytes + sum(len(k) + len(v) + 4 for k, v in headers) > self.limits.max_head_bytes:
            # h11 caps a head still arriving; a whole one can come in one read (<= 256 KiB)
            status, code = 431, "request_header_fields_too_large"
            message = f"request head over {self.limits.max_head_bytes} bytes"
        else:
            await self._asgi_app(scope, receive, send)
            return
        body = json.dumps(error_body(status, message, code=code)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _await_head(self) -> None:
        self.shared.waiting[self] = None
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.shared.waiting.pop(self, None)
        if not self.conn.trailing_data[0]:
            self.transport.close()  # sent nothing (or nothing more after a response)
            return
        message = f"request head not received within {self.limits.header_timeout_s} s"
        self._refuse(refusal(408, message, "request_timeout"))

    def _body_late(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        cycle = self.cycle
        started = cycle is not None and cycle.response_started
        if cycle is not None:
            cycle.disconnected = True  # the app reads a disconnect; its sends go nowhere
            cycle.message_event.set()
        if started:
            self.transport.close()
            return
        message = f"request body not received within {self.limits.body_timeout_s} s"
        self._refuse(refusal(408, message, "request_timeout"))

    def _refuse(self, response: bytes) -> None:
        """Write ``response``, half-close, drop what the client still sends, close later."""
        self._cancel_timers()
        self.shared.waiting.pop(self, None)
        self.transport.write(response)
        if self.shared.lingering >= MAX_LINGERING:
            self.transport.close()
            return
        self._lingering = True
        self.shared.lingering += 1
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        self.loop.call_later(LINGER_S, self.transport.close)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
