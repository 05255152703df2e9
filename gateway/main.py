"""Run the gateway app under uvicorn until the stop event (or uvicorn's own signal) fires."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.edge import EdgeLimits, edge_protocol
from gateway.settings import GatewaySettings


def server_config(app: Callable[..., Any], settings: GatewaySettings) -> uvicorn.Config:
    """uvicorn on the bounded h11 edge (gateway/edge.py): head and connection limits,
    header, body and keep-alive timeouts."""
    limits = EdgeLimits.from_settings(settings)
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=edge_protocol(limits),
        h11_max_incomplete_event_size=limits.max_head_bytes,
        timeout_keep_alive=max(1, round(limits.keep_alive_s)),  # the edge uses the exact one
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),
    )


async def serve(settings: GatewaySettings, stop: asyncio.Event) -> None:
    app = create_app(settings)
    server = uvicorn.Server(server_config(app, settings))
    serving = asyncio.create_task(server.serve())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    stopping.cancel()
    await serving
