"""Running an asyncio service until SIGINT/SIGTERM, then letting it drain."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import structlog
from redis.exceptions import RedisError

log = structlog.get_logger(__name__)


def run_service(service: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``service`` until SIGINT/SIGTERM on uvloop when it is installed (a faster event
    loop for the services' socket-heavy work), else on asyncio's own."""
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run_until_signalled(service))


async def run_until_signalled(service: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service(stop)


async def loop_with_backoff(
    iterate: Callable[[], Awaitable[None]],
    stop: asyncio.Event,
    on_error: Callable[[RedisError], Awaitable[None]] | None = None,
) -> None:
    """Call ``iterate`` until ``stop``; an error (Redis away or restarted, or a value nobody
    expected) is logged and retried with exponential backoff (50 ms doubling to 0.5 s): a service
    never dies of one. ``on_error`` sees Redis errors (e.g. to re-create a consumer group)."""
    backoff_s = 0.05
    while not stop.is_set():
        try:
            await iterate()
            backoff_s = 0.05
        except Exception as exc:
            if isinstance(exc, RedisError):
                log.error("redis_error", error=str(exc), retry_in_s=backoff_s)
            else:
                log.exception("loop_error", error=repr(exc), retry_in_s=backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(0.5, backoff_s * 2)
            if on_error is not None and isinstance(exc, RedisError):
                await on_error(exc)
