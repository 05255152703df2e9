"""Orphans: a worker aborts the requests of a gateway that stopped heartbeating within a few
seconds (each ends with an error on the gateway's output stream, which stays until the gateway
is forgotten: a gateway that was only frozen reads them), while another gateway's requests go
on; the watch
judges by change on the worker's own clock, so a gap in its watching or a gateway that never
beat kills nothing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from redis.asyncio import Redis

from data_plane.orphans import GatewayWatch
from gateway.dispatcher import Dispatcher
from gateway.inflight import InFlightRequests
from shared import streams
from tests.data_plane.worker_support import (
    RunningWorker,
    finished_outputs,
    push,
    running_worker,
    settings,
    submit,
)

DEAD_S = 1.0
DOOMED = streams.gateway_outputs_stream("doomed")
LIVE = streams.gateway_outputs_stream("live")


def test_a_gateway_is_dead_after_its_beat_stopped_changing_for_dead_s() -> None:
    watch = GatewayWatch(dead_s=1.0, forget_s=3600.0)
    watch.observe({"a": b"1", "b": b"1"}, 0.0)
    for now in (0.4, 0.8):
        watch.observe({"a": b"1", "b": str(now).encode()}, now)
    assert not watch.dead
    watch.observe({"a": b"1", "b": b"1.2"}, 1.2)
    assert watch.dead == watch.unswept == {"a"}
    assert watch.owns_dead("superinfer:gateway:a:outputs")
    assert not watch.owns_dead("superinfer:gateway:b:outputs") and not watch.owns_dead("x")
    watch.observe({"a": b"2", "b": b"1.2"}, 1.6)  # a beats again
    assert not watch.dead and not watch.unswept


def test_a_gap_in_watching_or_no_heartbeat_at_all_kills_nothing() -> None:
    watch = GatewayWatch(dead_s=1.0, forget_s=3600.0)
    watch.observe({"a": b"1"}, 0.0)
    watch.observe({"a": b"1"}, 5.0)  # Redis was away for 5 s: nobody could beat
    watch.observe({"a": b"1"}, 5.4)
    assert not watch.dead  # counted again from 5.0
    watch.observe({"a": b"1"}, 5.8)
    watch.observe({"a": b"1"}, 6.1)
    assert watch.dead == {"a"}
    watch.observe({}, 6.2)  # gone from the hash (forgotten, or Redis lost it): unknown
    assert not watch.dead and not watch.owns_dead("superinfer:gateway:a:outputs")


def test_a_request_of_a_dead_gateway_waits_one_poll_for_it_to_beat_again() -> None:
    """A gateway restarted with its id sends before the worker's next poll: served once it
    beats again (it was dropped: 504 after 60 s); one still dead at the poll is dropped."""
    watch = GatewayWatch(dead_s=1.0, forget_s=3600.0)
    for now in (0.0, 0.4, 0.8, 1.1):
        watch.observe({"a": b"1", "b": b"1"}, now)
    assert watch.dead == {"a", "b"}
    for gateway in ("a", "b"):
        watch.park(submit(f"{gateway}-1", reply=streams.gateway_outputs_stream(gateway)))
    assert watch.unparked() == ([], [])  # no poll since: neither is known to be back
    watch.observe({"a": b"2", "b": b"1"}, 1.3)  # a restarted and beats; b is still dead
    revived, dropped = watch.unparked()
    assert [r.request_id for r in revived] == ["a-1"]
    assert [r.request_id for r in dropped] == ["b-1"]  # the worker ends it with an error
    assert watch.unparked() == ([], [])


async def test_stale_heartbeats_leave_the_hash_with_their_dead_gateways_streams(
    redis_client: Redis,
) -> None:
    """A stale entry leaves the hash; its output stream goes only when this worker called
    that gateway dead by its own watching (an old-looking beat that keeps changing is a
    skewed clock's: its gateway lives, its stream stays)."""
    watch = GatewayWatch(dead_s=0.3, forget_s=0.5)
    gateways = ("stopped", "skewed", "live")
    for gateway in gateways:
        await redis_client.xadd(streams.gateway_outputs_stream(gateway), {"m": b"x"})
    await redis_client.hset(streams.GATEWAYS_KEY, "stopped", time.time())
    for i in range(12):  # 1.2 s of polls: "stopped" is called dead, then forgotten
        now = time.time()
        beats = {"skewed": now - 7200 + i, "live": now}
        await redis_client.hset(streams.GATEWAYS_KEY, mapping=beats)
        await watch.poll(redis_client)
        await asyncio.sleep(0.1)
    assert not await redis_client.exists(streams.gateway_outputs_stream("stopped"))
    assert await redis_client.hkeys(streams.GATEWAYS_KEY) == [b"live"]
    for kept in ("skewed", "live"):
        assert await redis_client.exists(streams.gateway_outputs_stream(kept))
    await redis_client.delete(*(streams.gateway_outputs_stream(g) for g in gateways))
    await redis_client.delete(streams.GATEWAYS_KEY)


async def _beat(redis: Redis, gateway_id: str) -> None:
    while True:  # a gateway's refresh loop, until it is killed (cancelled)
        await redis.hset(streams.GATEWAYS_KEY, gateway_id, f"{time.time():.3f}")
        await asyncio.sleep(0.1)


async def _first_output(redis: Redis, stream: str) -> None:
    deadline = time.monotonic() + 15
    while not await redis.xlen(stream):
        assert time.monotonic() < deadline, f"no output on {stream}"
        await asyncio.sleep(0.02)


async def test_a_killed_gateways_requests_are_aborted_within_seconds(
    redis_client: Redis, stories_path: Path
) -> None:
    beats = {g: asyncio.create_task(_beat(redis_client, g)) for g in ("doomed", "live")}
    config = settings(stories_path, gateway_dead_s=DEAD_S, num_hbm_blocks=512)
    try:
        async with running_worker(config) as running:
            await _kill_one_of_two_gateways(redis_client, running, beats["doomed"])
    finally:
        for task in beats.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _kill_one_of_two_gateways(
    redis: Redis, running: RunningWorker, doomed_beat: asyncio.Task[None]
) -> None:
    real_step = running.worker.engine.step

    def slow_step() -> list:
        time.sleep(0.03)  # ~8 s for 250 tokens: far longer than the detection
        return real_step()

    running.worker.engine.step = slow_step  # type: ignore[method-assign]
    doomed = {f"d{i}" for i in range(3)}
    await push(redis, *(submit(r, 250, DOOMED) for r in sorted(doomed)))
    await push(redis, submit("alive", 60, LIVE))
    await _first_output(redis, DOOMED)  # they run
    doomed_beat.cancel()  # kill -9: the doomed gateway beats no more
    t_killed = time.monotonic()
    while doomed & set(running.worker.replies.request_ids()):
        assert time.monotonic() - t_killed < DEAD_S + 3, "orphans still running"
        await asyncio.sleep(0.02)
    aborted_after_s = time.monotonic() - t_killed
    # what the gateway reads if it was only frozen: each request ends with an error naming it
    ended = await finished_outputs(redis, doomed, 10, DOOMED)
    for output in ended.values():
        assert output.error is not None and "gateway doomed sent no heartbeat" in output.error
    (alive,) = (await finished_outputs(redis, {"alive"}, 30, LIVE)).values()
    assert alive.finish_reason == "length" and alive.error is None  # the live gateway's went on
    lifecycle = await redis.hgetall(streams.request_lifecycle_key("d0"))
    assert lifecycle[b"finish_reason"] == b"abort" and lifecycle[b"orphaned"] == b"1"
    assert not running.worker.engine.has_unfinished()
    print(f"orphans aborted {aborted_after_s:.2f} s after their gateway died (dead_s {DEAD_S})")


async def test_a_gateway_restarted_under_its_id_has_its_old_requests_aborted(
    redis_client: Redis, stories_path: Path
) -> None:
    """Restarted within gateway_dead_s, its heartbeat never stood still: the old incarnation's
    requests ran to max_tokens for nobody. The new incarnation tells the workers before it
    submits; its own request, sent right after, is served."""
    await redis_client.hset(streams.GATEWAYS_KEY, "doomed", f"{time.time():.3f}")
    async with running_worker(settings(stories_path, num_hbm_blocks=512)) as running:
        real_step = running.worker.engine.step

        def slow_step() -> list:
            time.sleep(0.03)
            return real_step()

        running.worker.engine.step = slow_step  # type: ignore[method-assign]
        old = {f"d{i}" for i in range(3)}
        await push(redis_client, *(submit(r, 250, DOOMED) for r in sorted(old)))
        await _first_output(redis_client, DOOMED)  # they run
        restarted = Dispatcher(redis_client, "doomed", 10, InFlightRequests())
        await restarted.abort_previous_incarnation(["w0"])
        await push(redis_client, submit("new", 8, DOOMED))
        (new,) = (await finished_outputs(redis_client, {"new"}, 30, DOOMED)).values()
        assert new.finish_reason == "length" and new.error is None
        assert not old & set(running.worker.replies.request_ids())
        lifecycle = await redis_client.hgetall(streams.request_lifecycle_key("d0"))
        assert lifecycle[b"finish_reason"] == b"abort"
    await redis_client.delete(DOOMED, streams.GATEWAYS_KEY)
