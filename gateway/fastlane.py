"""A fast lane for the endpoints every generation goes through (POST /v1/completions and
/v1/chat/completions), in front of FastAPI's router.

FastAPI's routing, exception middleware, exit stacks and body dependency cost a request about
as much as everything the gateway itself does before it submits the request. Here a JSON body
that parses and validates (``json.loads`` then the request model, as FastAPI does) goes
straight to the same endpoint function; an APIError it raises gets the same answer as from the
registered handler, any other exception the same generic 500. Anything else goes to FastAPI
with the body replayed, so every other answer is FastAPI's own: another path, method or
content type, a root path, a body that is empty, not JSON or not valid (the 400 names the
field, as always), or that fails to parse in any way at all (nested too deep for the parser,
an integer too long to convert...).

So there is one validation path for both lanes: a body either parses and validates here,
exactly as FastAPI would (``json.loads`` then the same model), or FastAPI answers it; the checks
after validation are in the endpoint functions both lanes call. It sits inside the body limit
(413) and the server-error middleware, which see every request as before."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import Request
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import (
    APIError,
    api_error_response,
    http_error_response,
    unexpected_error_response,
)

Endpoint = Callable[[Any, Request], Awaitable[Response]]
FastRoutes = Mapping[str, tuple[type[BaseModel], Endpoint]]


class FastLane:
    def __init__(self, app: ASGIApp, routes: FastRoutes) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._route(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        model, endpoint = route
        try:
            messages, body = await _read_body(receive)
        except StarletteHTTPException as exc:  # over the body limit while it came in
            await http_error_response(exc)(scope, receive, send)
            return
        parsed = _parse(model, body)
        if parsed is None:
            await self.app(scope, _replay(messages, receive), send)
            return
        try:
            response = await endpoint(parsed, Request(scope, receive))
        except APIError as exc:
            response = api_error_response(exc)
        except Exception as exc:  # as the registered handler answers it on FastAPI's side
            response = unexpected_error_response(exc)
        await response(scope, receive, send)

    def _route(self, scope: Scope) -> tuple[type[BaseModel], Endpoint] | None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return None
        route = self.routes.get(scope["path"])
        if route is None or not _json_content(scope):
            return None
        return route


def _json_content(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return bool(value.split(b";", 1)[0].strip().lower() == b"application/json")
    return False


async def _read_body(receive: Receive) -> tuple[list[Message], bytes | None]:
    """The messages received and the whole body (None when the client left first)."""
    messages: list[Message] = []
    chunks: list[bytes] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return messages, b"".join(chunks)


def _parse(model: type[BaseModel], body: bytes | None) -> BaseModel | None:
    """The validated body, or None for FastAPI to answer (whatever went wrong: not JSON,
    RecursionError for deep nesting, ValueError for a 5000-digit integer, ValidationError)."""
    if not body:
        return None
    try:
        return model.model_validate(json.loads(body))
    except Exception:
        return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` as if nothing had been read yet."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
