"""Build and run the control plane from settings."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from control_plane.service import ControlPlane
from control_plane.settings import ControlPlaneSettings


async def serve(settings: ControlPlaneSettings, stop: asyncio.Event) -> None:
    redis = Redis.from_url(settings.redis_url)
    try:
        await ControlPlane(settings, redis).run(stop)
    finally:
        await redis.aclose()
