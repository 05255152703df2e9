"""What a gateway reads from Redis cannot take it out of service: a worker is alive while its
heartbeat keeps changing on the gateway's own clock (a worker whose clock ran seconds behind
had every request failed as lost), a stale entry of a dead worker is not alive, knobs or SLO
classes in Redis that do not validate leave the last good ones in force (they failed every
refresh: no worker was routable), an abort Redis refused is sent after the next read, and a
request with no token yet leaves a draining worker at once or follows a restarted one."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.dispatcher import Dispatcher
from gateway.generation import GenerationParams
from gateway.generation_service import GenerationService
from gateway.inflight import InFlightRequests, Route
from gateway.limits import KeyLimiter
from gateway.metrics import GatewayMetrics
from gateway.placement import Placement
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from gateway.workers import WorkerDirectory
from shared import streams
from shared.policy import Knobs
from shared.protocol import AbortRequest, SubmitRequest, WorkerStatus, decode, encode
from shared.sampling import SamplingParams
from shared.slo import DEFAULT_SLO_CLASSES
from shared.tokenizer import ByteTokenizer
from tests.gateway.test_metrics_vllm import _status
from tests.redis_support import redis_url

BEHIND_S = 30.0  # a worker clock this far behind the gateway's


async def _beat(redis: Redis, status: WorkerStatus) -> None:
    await redis.hset(streams.WORKERS_KEY, status.worker_id, encode(status))


async def test_a_worker_whose_clock_is_behind_is_alive_while_it_beats(redis_client: Redis) -> None:
    directory = WorkerDirectory(redis_client, GatewaySettings(model="tiny-random"))
    skewed = _status("skewed", t_heartbeat_s=time.time() - BEHIND_S)
    stale = _status("stale", t_heartbeat_s=time.time() - 3 * 3600)  # a dead worker's entry
    await _beat(redis_client, skewed)
    await _beat(redis_client, stale)
    await directory.refresh()
    assert directory.alive() == []  # first sight: aged by the wall clocks
    for _ in range(3):  # it beats (its clock still 30 s behind): alive on the gateway's clock
        skewed = dataclasses.replace(skewed, t_heartbeat_s=skewed.t_heartbeat_s + 0.5)
        await _beat(redis_client, skewed)
        await directory.refresh()
        assert [s.worker_id for s in directory.alive()] == ["skewed"]
        assert directory.beat_age_s(skewed) < 1.0
    alive_s = directory.settings.worker_alive_s
    assert directory.beat_age_s(directory.statuses["stale"]) > alive_s


async def test_a_worker_silent_past_worker_dead_s_takes_no_new_request(
    redis_client: Redis,
) -> None:
    """Its in-flight requests are moved off it after ``worker_dead_s``: new ones went to it for
    2 s more (until ``worker_alive_s``) and were lost at once."""
    settings = GatewaySettings(model="tiny-random", worker_dead_s=0.3, worker_alive_s=5.0)
    directory = WorkerDirectory(redis_client, settings)
    silent = _status("silent")
    await _beat(redis_client, silent)
    for _ in range(2):  # seen beating
        silent = dataclasses.replace(silent, t_heartbeat_s=silent.t_heartbeat_s + 0.1)
        await _beat(redis_client, silent)
        await directory.refresh()
    assert [s.worker_id for s in directory.routable()] == ["silent"]
    await asyncio.sleep(0.5)  # it stops beating
    await directory.refresh()
    assert [s.worker_id for s in directory.alive()] == ["silent"]  # ready still (5 s)
    assert directory.routable() == []
    assert directory.no_worker_error().status_code == 503


async def test_invalid_knobs_or_classes_in_redis_keep_the_last_good(redis_client: Redis) -> None:
    directory = WorkerDirectory(redis_client, GatewaySettings(model="tiny-random"))
    await redis_client.hset(streams.KNOBS_KEY, mapping={"alpha": "2.5", "version": 3})
    await directory.refresh()
    assert directory.knobs.alpha == 2.5 and directory.knobs_version == 3
    await redis_client.hset(streams.KNOBS_KEY, mapping={"alpha": "-1", "version": 4})
    await redis_client.hset(streams.SLO_CLASSES_KEY, "version", "not a number")
    await _beat(redis_client, _status("w0"))
    await directory.refresh()  # raised ValueError: every refresh failed
    assert directory.redis_ok and [s.worker_id for s in directory.alive()] == ["w0"]
    assert directory.knobs.alpha == 2.5 and directory.knobs_version == 3
    assert directory.knobs != Knobs()


async def test_an_abort_redis_refused_goes_out_after_the_next_read(redis_client: Redis) -> None:
    dispatcher = Dispatcher(redis_client, "gw", 10, InFlightRequests())
    routes = [Route("w0", "e1", f"r{i}") for i in range(3)]
    for route in routes:
        dispatcher.abort_after_next_read(route)
    await dispatcher._read_once()  # a good read: the queued aborts are sent
    entries = await redis_client.xrange(streams.worker_requests_stream("w0"))
    sent = [decode(fields[b"m"], AbortRequest).request_id for _, fields in entries]
    assert sent == ["r0", "r1", "r2"]


def _service(redis: Redis, **overrides: Any) -> GenerationService:
    settings = GatewaySettings(model="tiny-random", **overrides)
    directory = WorkerDirectory(redis, settings)
    dispatcher = Dispatcher(redis, "gw", 10, InFlightRequests())
    metrics = GatewayMetrics(directory, "m", vllm=False)
    return GenerationService(settings, redis, ByteTokenizer(), dispatcher, directory, metrics)


async def _submits(redis: Redis, worker_id: str) -> list[str]:
    entries = await redis.xrange(streams.worker_requests_stream(worker_id))
    return [msg.request_id for _, f in entries if isinstance(msg := decode(f[b"m"]), SubmitRequest)]


async def test_a_draining_or_restarted_workers_waiting_requests_move(redis_client: Redis) -> None:
    """No token yet on a draining worker: moved at once to one that takes requests (they
    waited out the drain, then failed); with none, they wait for its next incarnation and go
    there (a worker's restart failed them when it was the only one)."""
    service = _service(redis_client)
    params = GenerationParams(
        [1, 2, 3], SamplingParams(max_tokens=4), DEFAULT_SLO_CLASSES["interactive"]
    )
    await _beat(redis_client, _status("w0", epoch="e1"))
    await service.directory.refresh()
    generation = await service.start("r1", params)
    assert generation.record.route.worker_id == "w0"
    await _beat(redis_client, _status("w0", epoch="e1", accepting=False))  # draining, alone
    await service.directory.refresh()
    await service.check_workers()
    assert generation.record.route.epoch == "e1" and generation.record.outputs.error is None
    await _beat(redis_client, _status("w1", epoch="f1"))  # another worker joins
    await service.directory.refresh()
    await service.check_workers()
    assert generation.record.route.worker_id == "w1"
    await _beat(redis_client, _status("w1", epoch="f2"))  # w1 restarts: its next incarnation
    await service.directory.refresh()
    await service.check_workers()
    route = generation.record.route
    assert (route.worker_id, route.epoch) == (
        "w1",
        "f2",
    ) and generation.record.outputs.error is None
    assert await _submits(redis_client, "w1") == [route.wire_id]  # each move: its entry only
    assert await _submits(redis_client, "w0") == []


async def test_the_only_workers_clean_exit_keeps_its_waiting_requests(redis_client: Redis) -> None:
    """A worker that drains deletes its status as it exits: its requests with no token yet
    failed as ``worker_lost`` 3 s later although its next incarnation reads them; they now
    wait for it and follow it, while one that has tokens fails."""
    service = _service(redis_client, worker_dead_s=0.2)
    params = GenerationParams(
        [1, 2, 3], SamplingParams(max_tokens=4), DEFAULT_SLO_CLASSES["interactive"]
    )
    await _beat(redis_client, _status("w0", epoch="e1"))
    await service.directory.refresh()
    waiting = await service.start("r1", params)
    streaming = await service.start("r2", params)
    streaming.record.num_received = 1  # it had a token
    await _beat(redis_client, _status("w0", epoch="e1", accepting=False))  # draining
    await service.directory.refresh()
    await redis_client.hdel(streams.WORKERS_KEY, "w0")  # it exits cleanly
    await asyncio.sleep(0.3)
    await service.directory.refresh()
    await service.check_workers()
    assert waiting.record.outputs.error is None
    assert streaming.record.outputs.error is not None
    assert streaming.record.outputs.error.code == "worker_lost"
    await _beat(redis_client, _status("w0", epoch="e2"))  # its next incarnation
    await service.directory.refresh()
    await service.check_workers()
    assert waiting.record.route.epoch == "e2" and waiting.record.outputs.error is None


async def test_a_malformed_status_is_logged_once_not_every_refresh(redis_client: Redis) -> None:
    directory = WorkerDirectory(redis_client, GatewaySettings(model="tiny-random"))
    await redis_client.hset(streams.WORKERS_KEY, "junk", b"not msgpack")
    await _beat(redis_client, _status("w0"))
    for _ in range(4):
        await directory.refresh()
    assert directory.num_malformed == 1 and list(directory.statuses) == ["w0"]
    await redis_client.hset(streams.WORKERS_KEY, "junk", b"other junk")
    await directory.refresh()
    assert directory.num_malformed == 2  # a new bad value: counted and logged again


async def test_an_unreachable_redis_is_what_readiness_metrics_and_refusals_name(
    redis_client: Redis,
) -> None:
    """The refresh wrote the gateway's heartbeat first: with Redis gone that raised before the
    directory could record it, so /ready and ``superinfer:redis_up`` said Redis was fine and
    requests got 503 ``no_worker``, naming the wrong cause."""
    state = GatewayState(GatewaySettings(model="tiny-random", redis_url=redis_url()))
    try:
        await _beat(redis_client, _status("w0"))
        await redis_client.set(streams.CONTROL_PLANE_HEARTBEAT_KEY, "1", px=5_000)
        await state._refresh()
        assert state.directory.redis_ok and state.directory.control_plane_alive
        away = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        state.redis = state.directory.redis = away
        with pytest.raises(RedisConnectionError):
            await state._refresh()
        problems, _ = state.readiness()
        assert "redis unreachable" in problems and not state.directory.control_plane_alive
        assert state.directory.no_worker_error().code == "bus"
        await away.aclose()
    finally:
        state.prompts.close()
        state.grammar_thread.shutdown(wait=False)


async def test_a_worker_that_never_beats_again_is_forgotten(redis_client: Redis) -> None:
    """Its status and streams stayed forever (the admin API listed it, its request stream kept
    what was sent to it); one that beats is kept."""
    settings = GatewaySettings(model="tiny-random", worker_forget_s=0.3)
    directory = WorkerDirectory(redis_client, settings)
    live, dead = _status("live"), _status("dead")
    await _beat(redis_client, live)
    await _beat(redis_client, dead)
    await redis_client.xadd(streams.worker_requests_stream("dead"), {"m": b"x"})
    await directory.refresh()
    for _ in range(4):
        await asyncio.sleep(0.15)
        live = dataclasses.replace(live, t_heartbeat_s=live.t_heartbeat_s + 0.15)
        await _beat(redis_client, live)
        await directory.refresh()
    assert set(await redis_client.hkeys(streams.WORKERS_KEY)) == {b"live"}
    assert not await redis_client.exists(streams.worker_requests_stream("dead"))
    await redis_client.delete(streams.WORKERS_KEY)


async def test_a_burst_spreads_over_an_idle_and_a_lately_busy_worker(redis_client: Redis) -> None:
    """An idle worker reports 0 s a step: it drew all 40 requests of a burst from one that had
    just worked (its step time known) until the statuses caught up."""
    directory = WorkerDirectory(redis_client, GatewaySettings(model="tiny-random"))
    idle = _status("idle", iteration_time_s=0.0, decode_step_s=0.01)
    lately_busy = _status("busy", iteration_time_s=0.01, decode_step_s=0.01)
    for status in (idle, lately_busy):
        await _beat(redis_client, status)
    await directory.refresh()
    for status in (idle, lately_busy):  # beating: alive on this gateway's clock
        await _beat(redis_client, dataclasses.replace(status, t_heartbeat_s=time.time() + 0.5))
    await directory.refresh()
    keys = KeyLimiter(100, 1000.0)
    chosen = []
    for _ in range(40):
        status = directory.choose(10)
        Placement(directory, keys, status.worker_id, 10, None)  # counted where it went
        chosen.append(status.worker_id)
    assert min(chosen.count("idle"), chosen.count("busy")) >= 15, chosen
    await redis_client.delete(streams.WORKERS_KEY)
