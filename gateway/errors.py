"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a status.

A 4xx says what was wrong with the request. A 5xx body says only a generic message for its
status, our own fixed ``code`` (``bus``, ``no_worker``, ``worker_lost``...) and a request id; the
detail (a Redis error's text, a worker's failure, a traceback) goes to the log under that id,
never to the client."""

from __future__ import annotations

import traceback
import uuid
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = structlog.get_logger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}
_GENERIC = {
    500: "internal server error",
    502: "bad gateway: the request failed upstream",
    503: "service unavailable; retry later",
    504: "timed out waiting for the model",
}
_MAX_PARAM_CHARS = 64  # of one part of a field's location echoed in a 400


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.request_id: str | None = None  # set where a request id is known

    def body(self) -> dict[str, Any]:
        """The body the client sees: a 5xx is generic, its detail logged once, here."""
        if self.status_code < 500:
            return error_body(self.status_code, self.message, self.param, self.code)
        request_id = self.request_id or new_error_id()
        self.request_id = request_id
        log.error(
            "request_failed",
            request_id=request_id,
            status=self.status_code,
            code=self.code,
            detail=self.message,
        )
        return server_error_body(self.status_code, request_id, self.code)


def new_error_id() -> str:
    return f"err-{uuid.uuid4().hex}"


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Any text that is not valid Unicode (a lone surrogate echoed back) is escaped."""
    kind = _TYPES.get(
        status_code, "server_error" if status_code >= 500 else "invalid_request_error"
    )
    fields = {"message": _safe(message), "type": kind, "param": param and _safe(param)}
    return {"error": {**fields, "code": code}}


def _safe(text: str) -> str:
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode()


def server_error_body(status_code: int, request_id: str, code: str | None) -> dict[str, Any]:
    generic = _GENERIC.get(status_code, _GENERIC[500])
    return error_body(status_code, f"{generic} (request id {request_id})", None, code)


def api_error_response(exc: APIError) -> JSONResponse:
    body = exc.body()  # sets the request id of a 5xx
    headers = dict(exc.headers or {})
    if exc.request_id is not None:
        headers["x-request-id"] = exc.request_id
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def http_error_response(exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code >= 500:
        return api_error_response(APIError(exc.status_code, str(exc.detail)))
    return JSONResponse(
        error_body(exc.status_code, str(exc.detail)),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


def unexpected_error_response(exc: BaseException) -> JSONResponse:
    """A generic 500 for an exception nothing answered; its traceback goes to the log."""
    request_id = new_error_id()
    log.error(
        "unexpected_error",
        request_id=request_id,
        detail=f"{type(exc).__name__}: {exc}",
        traceback="".join(traceback.format_exception(exc)),
    )
    body = server_error_body(500, request_id, "internal_error")
    return JSONResponse(body, status_code=500, headers={"x-request-id": request_id})


def validation_error_response(errors: list[Any]) -> JSONResponse:
    """400 naming the first invalid field (``messages.0.content``), with pydantic's message.
    A field that takes several types fails once per type, under a tag for it (``prompt.str``,
    ``stop.list[str].0``): the field is the path before the tag, and the message the one of
    the type that got furthest into the value (``prompt: [-1]`` is a token id below 0, not
    "should be a valid string")."""
    first = errors[0] if errors else {}
    if first.get("type") != "json_invalid":
        field = _field_loc(first)
        same = [e for e in errors if _field_loc(e) == field]
        first = max(same, key=lambda e: len(e.get("loc", ())))  # the first of the deepest
        if len(same) > 1 and len(first.get("loc", ())) == len(same[0].get("loc", ())):
            first = {**first, "msg": _any_of(same)}  # no type got into the value
    if first.get("type") == "json_invalid":  # FastAPI's: loc ("body", position)
        where = first.get("loc", ("body", "?"))[-1]
        reason = first.get("ctx", {}).get("error", "JSON decode error")
        message = f"the body is not valid JSON ({reason} at character {where})"
        return JSONResponse(error_body(400, message), status_code=400)
    param = ".".join(_field_loc(first)) or None
    message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
    if first.get("type") == "extra_forbidden":  # inside a union member too: its whole path
        param = ".".join(_field_loc(first, past_tags=True)) or None
        message = f"'{param}' is not a field of this request (unknown fields are refused)"
    return JSONResponse(error_body(400, message, param), status_code=400)


def _any_of(errors: list[dict[str, Any]]) -> str:
    """One message for a value no member of a union took: "Input should be a valid string
    or a valid list" (each member's message once, in the union's order)."""
    prefix = "Input should be "
    wanted: list[str] = []
    for error in errors:
        msg = str(error.get("msg", ""))
        wanted_one = msg.removeprefix(prefix)
        if wanted_one not in wanted:
            wanted.append(wanted_one)
    return prefix + " or ".join(wanted)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_loc(error: dict[str, Any], past_tags: bool = False) -> list[str]:
    """The path of ``error``'s field: its location up to a union member's tag (or with the
    tags left out: ``past_tags``), no "body"."""
    loc: list[str] = []
    for part in error.get("loc", ()):
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part):
            if past_tags:
                continue
            break  # a union member's tag: the field is what came before
        if part != "body":
            loc.append(str(part)[:_MAX_PARAM_CHARS])
    return loc


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(list(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return unexpected_error_response(exc)


def bus_error(message: str, retry_after_s: int) -> APIError:
    """The 503 for a request that could not reach Redis (the request bus), with Retry-After
    as the other 503s: a client backs off and tries again."""
    return APIError(503, message, code="bus", headers={"Retry-After": str(retry_after_s)})
