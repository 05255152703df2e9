"""Running an asyncio service until SIGINT/SIGTERM, then letting it drain; garbage collection
at moments the service chooses."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import time
from collections.abc import Awaitable, Callable, Iterator

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
            collect_due_garbage()  # an iteration that failed did not get to its own
            await asyncio.sleep(backoff_s)
            backoff_s = min(0.5, backoff_s * 2)
            if on_error is not None and isinstance(exc, RedisError):
                await on_error(exc)


class _GcPacing:
    """Process-wide state of :func:`garbage_collected_between_iterations` (the collector it
    steers is process-wide too): how many services use it now, whether collection was on
    before the first one, when the last full pass ran."""

    num_users = 0
    was_enabled = True
    t_last_full_s = 0.0


_PACING = _GcPacing()
MIN_FULL_PASS_INTERVAL_S = 10.0  # CPython's own rule (long-lived objects grew by 25 %) is
# not readable from Python; a time floor bounds full passes over a growing heap instead


@contextlib.contextmanager
def garbage_collected_between_iterations() -> Iterator[None]:
    """Within: CPython's automatic collection is off and the service calls
    :func:`collect_due_garbage` at a moment of its choosing (after it published an iteration's
    results). Left automatic, a generation-1 pass (0.5-1.5 ms on a small host) fell inside
    the snapshot -> plan round trip about one snapshot in ten. The heap built at start-up
    (modules, model, engine) is frozen first, so a full pass never walks it again. Services
    running side by side in one process (tasks) share it: the first to enter freezes and
    disables, the last to leave unfreezes and restores collection as it was."""
    if _PACING.num_users == 0:
        _PACING.was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()
        _PACING.t_last_full_s = time.monotonic()
    _PACING.num_users += 1
    try:
        yield
    finally:
        _PACING.num_users -= 1
        if _PACING.num_users == 0:
            gc.unfreeze()
            if _PACING.was_enabled:
                gc.enable()


def collect_due_garbage() -> None:
    """The collection CPython's thresholds call for by now, if any (its counts keep rising while
    automatic collection is off): generation 0 or 1, or a full pass at most every
    ``MIN_FULL_PASS_INTERVAL_S`` (else generation 1)."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    if counts[0] < thresholds[0]:
        return
    if counts[1] < thresholds[1]:
        gc.collect(0)
        return
    now = time.monotonic()
    if counts[2] >= thresholds[2] and now - _PACING.t_last_full_s >= MIN_FULL_PASS_INTERVAL_S:
        _PACING.t_last_full_s = now
        gc.collect(2)
    else:
        gc.collect(1)
