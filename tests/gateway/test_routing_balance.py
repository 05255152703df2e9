"""Which worker a new request goes to: like workers share a burst evenly although their
measured step times differ by noise (by lag alone, one drew a whole burst until the statuses
caught up: 24/0 over two workers), a worker lagging well behind draws nothing, and the requests
a worker holds count whether it reported them or this gateway just sent them."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
from redis.asyncio import Redis

from gateway.limits import KeyLimiter
from gateway.placement import Placement
from gateway.settings import GatewaySettings
from gateway.workers import WorkerDirectory
from shared import streams
from shared.policy import decode_step_s, least_loaded
from shared.protocol import WorkerStatus, encode
from tests.gateway.test_metrics_vllm import _status


def _idle(worker_id: str, iteration_time_s: float) -> WorkerStatus:
    """Holding no request; its decode steps fitted flat at ``iteration_time_s``."""
    return _status(
        worker_id,
        iteration_time_s=iteration_time_s,
        decode_step_s=iteration_time_s,
        decode_base_s=iteration_time_s,
        decode_s_per_request=0.0,
        num_running=0,
        num_waiting=0,
        num_rotary=0,
        num_waiting_tokens=0,
        num_free_hbm_blocks=100,
    )


async def _directory(redis: Redis, statuses: list[WorkerStatus]) -> WorkerDirectory:
    """A directory that sees every status beating (alive on its own clock)."""
    directory = WorkerDirectory(redis, GatewaySettings(model="tiny-random"))
    for beat_s in (0.0, 0.5):
        for status in statuses:
            fresh = dataclasses.replace(status, t_heartbeat_s=time.time() + beat_s)
            await redis.hset(streams.WORKERS_KEY, status.worker_id, encode(fresh))
        await directory.refresh()
    return directory


def _route(directory: WorkerDirectory, num_requests: int) -> tuple[list[str], list[Placement]]:
    keys = KeyLimiter(1000, 1000.0)
    chosen, placements = [], []
    for _ in range(num_requests):
        worker_id = directory.choose(10).worker_id
        placements.append(Placement(directory, keys, worker_id, 10, None))
        chosen.append(worker_id)
    return chosen, placements


async def test_a_burst_splits_evenly_over_like_workers_whose_step_times_differ_by_noise(
    redis_client: Redis,
) -> None:
    directory = await _directory(redis_client, [_idle("a", 0.005), _idle("b", 0.0056)])
    chosen, placements = _route(directory, 24)
    assert chosen.count("a") == chosen.count("b") == 12, chosen
    for placement, worker_id in zip(placements[:12], chosen[:12], strict=True):
        placement.started(worker_id)  # a first token leaves the queue, not the worker
    assert [directory.num_requests(s) for s in directory.routable()] == [12, 12]
    for placement, worker_id in zip(placements, chosen, strict=True):
        placement.release(worker_id)
    assert directory.queued == {}  # ended: nothing left counted
    await redis_client.delete(streams.WORKERS_KEY)


async def test_a_worker_left_idle_with_a_stale_step_time_draws_its_share(
    redis_client: Redis,
) -> None:
    """Idle, a worker reports the decode steps it last ran (19.6 ms, at a burst's load): served,
    it drew no request of five bursts of 24 while its peer's recent steps said 3.5 ms. Both
    fitted the same step time to the batch size: the lag comes from that."""
    fit = {"decode_base_s": 0.002, "decode_s_per_request": 0.0007}
    stale = dataclasses.replace(_idle("stale", 0.0), decode_step_s=0.0196, **fit)
    idle = dataclasses.replace(_idle("idle", 0.0), decode_step_s=0.0035, **fit)
    busy = dataclasses.replace(_idle("busy", 0.0035), num_running=2, **fit)
    directory = await _directory(redis_client, [stale, idle])
    chosen, _ = _route(directory, 24)
    assert chosen.count("stale") == chosen.count("idle") == 12, chosen
    await redis_client.delete(streams.WORKERS_KEY)
    directory = await _directory(redis_client, [stale, busy])
    chosen, _ = _route(directory, 24)
    assert chosen.count("stale") == 13 and chosen.count("busy") == 11, chosen
    await redis_client.delete(streams.WORKERS_KEY)


async def test_a_restamped_status_keeps_the_count_of_sends_a_rebuilt_one_restarts_it(
    redis_client: Redis,
) -> None:
    """A worker sends its cached status again with each heartbeat and rebuilds it between
    steps: a re-stamp reset the count, and the next 12 requests went 12/0 to a worker that
    had 12 already."""
    directory = await _directory(redis_client, [_idle("a", 0.005), _idle("b", 0.005)])
    chosen, _ = _route(directory, 24)
    assert chosen.count("a") == 12
    a = directory.statuses["a"]
    restamped = dataclasses.replace(a, t_heartbeat_s=a.t_heartbeat_s + 0.5)
    await redis_client.hset(streams.WORKERS_KEY, "a", encode(restamped))
    await directory.refresh()
    chosen, _ = _route(directory, 12)
    assert chosen.count("a") == chosen.count("b") == 6, chosen
    rebuilt = dataclasses.replace(restamped, t_heartbeat_s=a.t_heartbeat_s + 1.0, num_waiting=18)
    await redis_client.hset(streams.WORKERS_KEY, "a", encode(rebuilt))
    await directory.refresh()  # a: 18 of its own count; b: 18 sent since its status
    assert [directory.num_requests(s) for s in directory.routable()] == [18, 18]
    await redis_client.delete(streams.WORKERS_KEY)


async def test_a_worker_whose_status_is_not_a_number_ranks_last(redis_client: Redis) -> None:
    nan = dataclasses.replace(_idle("nan", math.nan), decode_base_s=math.nan)
    directory = await _directory(redis_client, [nan, _idle("ok", 0.005)])
    chosen, _ = _route(directory, 4)
    assert chosen == ["ok"] * 4  # routing goes on (a NaN lag first in line raised)
    assert least_loaded([math.nan, 0.01], [0, 0]) == 1
    assert least_loaded([math.nan, math.inf], [1, 0]) == 1  # no lag at all: fewest requests
    await redis_client.delete(streams.WORKERS_KEY)


async def test_a_worker_lagging_well_behind_draws_nothing_while_the_other_keeps_up(
    redis_client: Redis,
) -> None:
    directory = await _directory(redis_client, [_idle("fast", 0.005), _idle("slow", 0.02)])
    chosen, _ = _route(directory, 10)
    assert chosen == ["fast"] * 10
    await redis_client.delete(streams.WORKERS_KEY)


async def test_requests_a_worker_reported_count_before_this_gateways_sends(
    redis_client: Redis,
) -> None:
    """Another gateway's 6 requests on ``a`` (in its status): this one fills ``b`` to 6 first."""
    busy = dataclasses.replace(_idle("a", 0.005), num_running=6)
    directory = await _directory(redis_client, [busy, _idle("b", 0.005)])
    chosen, _ = _route(directory, 10)
    assert chosen[:6] == ["b"] * 6 and sorted(chosen[6:]) == ["a", "a", "b", "b"], chosen
    await redis_client.delete(streams.WORKERS_KEY)


def test_least_loaded_prefers_fewer_requests_among_near_lags_then_the_lag() -> None:
    assert least_loaded([1.0, 1.2, 1.1], [5, 3, 3]) == 2  # both near: fewer, then less lag
    assert least_loaded([1.0, 1.3], [5, 0]) == 0  # 30 % behind: not near
    with pytest.raises(ValueError, match="one lag"):
        least_loaded([1.0], [1, 2])
    with pytest.raises(ValueError, match="at least one"):
        least_loaded([], [])


def test_a_decode_step_is_predicted_from_a_fit_workers_send_and_nothing_else() -> None:
    assert decode_step_s(0.002, 0.0007, 10) == pytest.approx(0.009)
    for base_s, per_request_s in ((0.0, 0.0), (-1.0, 0.1), (0.1, -1.0), (math.nan, 0.1)):
        assert decode_step_s(base_s, per_request_s, 10) is None  # the status's own step then
    assert decode_step_s(0.0, 0.001, 10) == pytest.approx(0.01)
