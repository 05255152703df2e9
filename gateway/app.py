"""The gateway's FastAPI app, built by :func:`create_app` from settings.

With ``require_api_key`` nothing but /health, /ready and /ping is open: /v1 needs an API key,
/openapi.json an API key or the admin token, /docs and /redoc are off (their pages cannot send
a bearer token to fetch the schema), and /metrics the admin token or ``metrics_token`` (a
scrape-only token for Prometheus; once set it is needed in open mode too)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import admin, openai_routes, responses_routes
from gateway.auth import carries
from gateway.errors import APIError, error_body, install_error_handlers
from gateway.fastlane import FastLane
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from gateway.tenancy import authenticate
from shared.errors import ConfigError


def create_app(settings: GatewaySettings) -> FastAPI:
    """Raises ValueError when the admin API would be open (no token and not disabled), and
    the tokenizer's errors for a bad model path."""
    if settings.admin_token is None and not settings.admin_disabled:
        raise ConfigError(
            "set an admin token (SUPERINFER_ADMIN_TOKEN, at least 16 characters) or disable the "
            "admin API (SUPERINFER_ADMIN_DISABLED=1)"
        )
    state = GatewayState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.close()

    locked = settings.require_api_key
    app = FastAPI(
        title="SuperInfer gateway",
        version="0.1.0",
        lifespan=lifespan,
        openapi_url=None if locked else "/openapi.json",
        docs_url=None if locked else "/docs",
        redoc_url=None if locked else "/redoc",
    )
    app.state.gateway = state
    install_error_handlers(app)
    app.add_middleware(FastLane, routes=openai_routes.fast_routes())  # inside the body limit
    app.add_middleware(_BodyLimit, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(  # outermost: a preflight is answered before any limit or route
        CORSMiddleware,
        allow_origins=settings.allowed_origins,
        allow_methods=settings.allowed_methods,
        allow_headers=settings.allowed_headers,
        allow_credentials=settings.allow_credentials,
    )
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    if not settings.admin_disabled:
        app.include_router(admin.router)

    _add_service_routes(app, state)
    return app


def _add_service_routes(app: FastAPI, state: GatewayState) -> None:
    """/health, /ready, /metrics, and /openapi.json behind a key when keys are required."""
    settings = state.settings
    locked = settings.require_api_key
    admin_token = settings.admin_token if not settings.admin_disabled else None

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """200 while the process serves HTTP (liveness: a restart cannot bring Redis back);
        the body tells when the request bus is lost (``/ready`` is 503 then)."""
        lost_for_s = state.dispatcher.bus_lost_for_s
        if lost_for_s is None:
            return {"status": "ok"}
        return {"status": "bus_lost", "bus_lost_for_s": round(lost_for_s, 1)}

    @app.get("/ready", response_model=None)
    async def ready() -> JSONResponse:
        """200 when this gateway can serve (Redis reachable, a live worker); ``warnings``
        name what is degraded but does not stop it (the control plane)."""
        problems, warnings = state.readiness()
        body: dict[str, Any] = {"ready": not problems, "problems": problems}
        body["warnings"] = warnings
        return JSONResponse(body, status_code=503 if problems else 200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        guarded = settings.metrics_token is not None or locked
        if guarded and not (
            carries(request, settings.metrics_token) or carries(request, admin_token)
        ):
            raise APIError(401, "the metrics or admin token is required", code="unauthorized")
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if locked:

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request) -> JSONResponse:
            if not carries(request, admin_token):
                await authenticate(state, request)  # 401 without a valid API key
            return JSONResponse(app.openapi())


class _BodyLimit:
    """413 for a body over the limit: a declared Content-Length before anything is read, a
    chunked body as soon as it grows past the limit. Plain ASGI, so streaming responses and
    disconnect detection pass through untouched."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            response = JSONResponse(
                error_body(413, f"request body over {self.max_body_bytes} bytes"), status_code=413
            )
            await response(scope, receive, send)
            return
        num_received = 0

        async def limited() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_body_bytes:
                    detail = f"request body over {self.max_body_bytes} bytes"
                    raise HTTPException(413, detail)  # FastAPI re-raises it (not an APIError)
            return message

        await self.app(scope, limited, send)
