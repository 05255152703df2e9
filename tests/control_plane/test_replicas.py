"""Control-plane replicas sharing workers: the lease logic, the publishing fence, and two
replicas over real Redis with stand-in workers (a replica killed, a replica paused)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from control_plane import snapshots
from control_plane.lease import (
    ALREADY_PLANNED,
    NOT_OWNER,
    PUBLISHED,
    Leases,
    fair_share,
    rebalance,
)
from control_plane.service import ControlPlane
from control_plane.settings import ControlPlaneSettings
from control_plane.snapshots import WorkerDirectory
from lab.standin import Fleet, make_fleet
from shared import streams
from shared.knobs import write_knobs
from tests.redis_support import redis_url


def test_fair_share_spreads_workers_evenly() -> None:
    assert fair_share(64, 2) == 32 and fair_share(65, 2) == 33 and fair_share(3, 0) == 3
    assert fair_share(0, 3) == 0


def test_rebalance_takes_up_to_the_share_and_gives_back_surplus_and_gone_workers() -> None:
    known = {"a", "b", "c", "d"}
    assert rebalance(set(), known, ["d", "a", "x"], 2) == (["d", "a"], [])  # x: not known
    assert rebalance({"a"}, known, ["b", "c"], 2) == (["b"], [])
    assert rebalance({"a", "b", "c"}, known, ["d"], 2) == ([], ["c"])
    assert rebalance({"a", "gone"}, known, ["b"], 2) == (["b"], ["gone"])


def _plan():
    from shared.protocol import RotationPlan

    return RotationPlan("w7", "e", 0, 1, "lvf", [], [], [], [], False, 0.0, 1)


async def test_workers_are_found_by_their_snapshots_and_forgotten_when_they_stop(
    redis_client,
) -> None:
    directory = WorkerDirectory(forget_s=0.3)
    key = streams.SNAPSHOT_WORKERS_KEY
    await redis_client.zadd(key, {"dead": 5.0, "live": 5.0})
    assert await directory.refresh(redis_client) == set()  # first sight: a score proves nothing
    await redis_client.zadd(key, {"live": 6.0, "new": 6.0})
    directory.joined(["new"])  # announced itself: alive at once
    assert directory.workers == {"new"}
    assert await directory.refresh(redis_client) == {"live", "new"}  # live's score moved
    await asyncio.sleep(0.35)
    await redis_client.zadd(key, {"new": 7.0})
    assert await directory.refresh(redis_client) == {"new"}  # live stopped publishing
    await redis_client.delete(key)


async def test_an_entry_from_a_clock_far_ahead_removes_no_other(
    redis_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries were deleted an hour behind the newest score: a worker whose clock ran over an
    hour fast (or one written by hand) wiped every other; now an entry goes once its score
    stood still for an hour of this replica's watching."""
    directory = WorkerDirectory(forget_s=0.3)
    key = streams.SNAPSHOT_WORKERS_KEY
    await redis_client.zadd(key, {"ahead": 9e18, "live": time.time()})
    await directory.refresh(redis_client)
    await redis_client.zadd(key, {"live": time.time()})
    assert await directory.refresh(redis_client) == {"live"}
    assert {m.decode() for m in await redis_client.zrange(key, 0, -1)} == {"ahead", "live"}
    monkeypatch.setattr(snapshots, "REGISTRY_KEEP_S", 0.2)
    await asyncio.sleep(0.3)
    await redis_client.zadd(key, {"live": time.time()})
    await directory.refresh(redis_client)  # "ahead" stood still past the keep time
    assert {m.decode() for m in await redis_client.zrange(key, 0, -1)} == {"live"}
    await redis_client.delete(key)


async def test_a_lease_is_held_renewed_and_released_only_by_its_holder(redis_client) -> None:
    a, b = Leases(redis_client, "a", 300), Leases(redis_client, "b", 300)
    await a.round({"w0", "w1"})  # alone: takes both
    assert a.owned == {"w0", "w1"}
    await b.round({"w0", "w1"})  # two replicas now: a's leases are still a's
    assert b.owned == set()
    b.owned = {"w0"}  # b wrongly believes it owns w0: renewing tells it otherwise
    await b.renew()
    assert b.owned == set() and b.num_lost == 1
    await b.release(["w0"])  # deletes nothing of a's
    assert await redis_client.get(streams.worker_owner_key("w0")) == b"a"
    await a.round({"w0", "w1"})  # share 1 with b alive: a gives one back
    assert len(a.owned) == 1
    await b.round({"w0", "w1"})
    assert len(b.owned) == 1 and a.owned.isdisjoint(b.owned)
    await asyncio.sleep(0.4)  # a stops renewing: its lease expires, b takes it
    await b.round({"w0", "w1"})
    assert b.owned == {"w0", "w1"}
    await a.renew()
    assert a.owned == set()
    await b.release_all()
    assert not await redis_client.exists(streams.worker_owner_key("w0"))


async def test_the_fence_admits_only_the_owner_and_each_iteration_once(redis_client) -> None:
    a, b = Leases(redis_client, "a", 5000), Leases(redis_client, "b", 5000)
    await a.round({"w0"})
    assert await b.publish([("w0", "e1", 5, b"p")]) == [NOT_OWNER]
    assert await a.publish([("w0", "e1", 5, b"p")]) == [PUBLISHED]
    assert await a.publish([("w0", "e1", 5, b"p"), ("w0", "e1", 4, b"p")]) == [
        ALREADY_PLANNED,
        ALREADY_PLANNED,
    ]
    assert await a.publish([("w0", "e2", 0, b"p")]) == [PUBLISHED]  # a new incarnation
    assert await redis_client.xlen(streams.worker_plans_stream("w0")) == 2
    await a.release(["w0"])
    assert await a.publish([("w0", "e2", 1, b"p")]) == [NOT_OWNER]


def _settings(replica_id: str) -> ControlPlaneSettings:
    return ControlPlaneSettings(
        redis_url=redis_url(),
        replica_id=replica_id,
        read_block_ms=20,
        knobs_poll_s=0.05,
        lease_ttl_ms=1000,
        lease_renew_s=0.1,
    )


class Replica:
    def __init__(self, replica_id: str) -> None:
        self.redis = Redis.from_url(redis_url())
        self.cp = ControlPlane(_settings(replica_id), self.redis)
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(self.cp.run(self.stop))

    async def close(self, kill: bool = False) -> None:
        """Stop cleanly, or (``kill``) like kill -9: cancelled until it is gone, nothing
        released (a cancellation can land where a library absorbs it: cancel again)."""
        while kill and not self.task.done():
            self.task.cancel()
            await asyncio.wait([self.task], timeout=0.05)
        self.stop.set()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.redis.aclose()


@pytest.fixture
async def fleet(redis_client) -> AsyncIterator[Fleet]:
    await write_knobs(redis_client, {"policy": "lvf"})
    redis = Redis.from_url(redis_url())
    fleet = make_fleet(redis, 6, 64, rate=20.0, max_num_seqs=8)  # most rows still: deltas
    stop = asyncio.Event()
    task = asyncio.create_task(fleet.run(stop))
    yield fleet
    stop.set()
    await task
    await redis.aclose()


async def _owners(redis: Redis, fleet: Fleet) -> list[bytes | str | None]:
    return await redis.mget([streams.worker_owner_key(s.worker_id) for s in fleet.standins])


async def _until(check, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def _split_between_two(redis_client, fleet: Fleet) -> tuple[Replica, Replica]:
    a, b = Replica("a"), Replica("b")

    async def split() -> bool:
        owners = await _owners(redis_client, fleet)
        return owners.count(b"a") == 3 and owners.count(b"b") == 3

    await _until(split, 5.0)
    await asyncio.sleep(0.5)  # both plan for their three
    assert a.cp.num_plans > 0 and b.cp.num_plans > 0
    return a, b


async def _all_planned_after(fleet: Fleet, iterations: dict[str, int]) -> bool:
    return all(
        s.newest is not None and s.newest.snapshot_iteration > iterations[s.worker_id] + 10
        for s in fleet.standins
    )


async def test_a_killed_replicas_workers_are_taken_over_within_5_s(redis_client, fleet) -> None:
    a, b = await _split_between_two(redis_client, fleet)
    await a.close(kill=True)
    assert a.task.cancelled()
    killed_at = {s.worker_id: s.iteration for s in fleet.standins}

    async def b_owns_all() -> bool:
        return await _owners(redis_client, fleet) == [b"b"] * 6

    took_s = await _until(b_owns_all, 5.0)
    await _until(lambda: _all_planned_after(fleet, killed_at), 3.0)  # plans flow again
    await b.close()
    assert await _owners(redis_client, fleet) == [None] * 6  # a clean stop releases
    assert fleet.totals().duplicates == 0
    assert fleet.totals().deltas > 0 and b.cp.reader.num_deltas > 0  # planned from deltas
    print(
        f"taken over in {took_s:.2f} s; b rebuilt {b.cp.reader.num_deltas} deltas, "
        f"{b.cp.reader.num_missing_base} against a's tables (skipped)"
    )


async def test_a_paused_replica_never_sends_a_second_plan_for_an_iteration(
    redis_client, fleet
) -> None:
    """Replica a stops renewing (a long pause) but keeps planning with its old view of what
    it owns; b takes its workers over. The fence keeps a's plans from reaching them."""
    a, b = await _split_between_two(redis_client, fleet)

    async def paused(known: set[str]) -> None:
        return None

    a.cp.leases.round = paused  # type: ignore[method-assign]
    paused_at = {s.worker_id: s.iteration for s in fleet.standins}

    async def b_owns_all() -> bool:
        return await _owners(redis_client, fleet) == [b"b"] * 6

    await _until(b_owns_all, 5.0)
    await _until(lambda: _all_planned_after(fleet, paused_at), 3.0)

    async def a_learned_it_lost_them() -> bool:  # from its refused plans, worker by worker
        return not a.cp.leases.owned

    await _until(a_learned_it_lost_them, 5.0)
    assert a.cp.num_fenced > 0  # a did try: Redis refused
    await a.close()
    await b.close()
    totals = fleet.totals()
    assert totals.plans > 0 and totals.duplicates == 0
