"""Running an asyncio service until SIGINT/SIGTERM, then letting it drain."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable


async def run_until_signalled(service: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service(stop)
