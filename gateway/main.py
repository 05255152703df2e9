"""Run the gateway app under uvicorn until the stop event (or uvicorn's own signal) fires."""

from __future__ import annotations

import asyncio

import uvicorn

from gateway.app import create_app
from gateway.settings import GatewaySettings


async def serve(settings: GatewaySettings, stop: asyncio.Event) -> None:
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    stopping.cancel()
    await serving
