"""Leases: which control-plane replica plans for which worker.

Each worker is owned by at most one replica at a time: its lease is a Redis key holding the
owner's replica id (``SET NX PX``), renewed with the replica's heartbeat by a compare-and-set
script and released by one (only the holder can renew or delete it). A replica that dies stops
renewing; its leases expire after ``lease_ttl_ms`` and the others take them over at their next
round. Every replica takes about an equal share: ``ceil(workers / live replicas)``, counted from
a sorted set of live replicas (expiry as score); one above its share releases the surplus.

Leases decide who *tries* to plan; the fence decides what reaches a worker. A plan is published
by one script that checks, inside Redis, that the sender holds the worker's lease and that no
plan was published yet for this snapshot's iteration or a later one of the same worker epoch
(``streams.worker_plan_fence_key``), then records the iteration and adds the plan to the
worker's plan stream. Ownership changes and publications are thus serialized in Redis: a replica
that lost its lease (expired while it was paused) publishes nothing, and a worker never gets two
plans for the same iteration, whatever the clocks and pauses.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from typing import Any

import structlog
from redis.asyncio import Redis

from shared import streams

log = structlog.get_logger(__name__)

FENCE_TTL_MS = 600_000  # a worker gone this long starts a fresh fence

# KEYS: owner keys; ARGV: replica id, ttl ms. Renews those held by the replica: 1 each, else 0.
RENEW_SCRIPT = """
local held = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('PEXPIRE', key, ARGV[2])
    held[i] = 1
  else
    held[i] = 0
  end
end
return held
"""
# KEYS: owner keys; ARGV: replica id. Deletes those held by the replica; returns how many.
RELEASE_SCRIPT = """
local released = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    released = released + redis.call('DEL', key)
  end
end
return released
"""
# KEYS: owner key, fence hash, plan stream; ARGV: replica id, epoch, iteration, maxlen, plan,
# fence ttl ms. 1: published; 0: not the owner; -1: that iteration (or a later one) was planned.
PUBLISH_SCRIPT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local last = redis.call('HMGET', KEYS[2], 'epoch', 'iteration')
if last[1] == ARGV[2] and tonumber(last[2]) >= tonumber(ARGV[3]) then
  return -1
end
redis.call('HSET', KEYS[2], 'epoch', ARGV[2], 'iteration', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[6])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'm', ARGV[5])
return 1
"""
PUBLISHED, NOT_OWNER, ALREADY_PLANNED = 1, 0, -1


def fair_share(num_workers: int, num_replicas: int) -> int:
    """How many workers one replica should own: the workers spread evenly, rounded up."""
    return -(-num_workers // max(1, num_replicas))


def rebalance(
    owned: set[str], known: set[str], free: Iterable[str], share: int
) -> tuple[list[str], list[str]]:
    """(workers to try to acquire, workers to release): owned workers no longer known are
    released; below ``share`` the replica tries free ones (in the order given), above it
    releases the surplus (sorted, so the choice is stable)."""
    gone = sorted(owned - known)
    staying = sorted(owned & known)
    if len(staying) > share:
        return [], gone + staying[share:]
    wanted = [w for w in free if w in known and w not in owned]
    return wanted[: share - len(staying)], gone


class Leases:
    """The workers this replica owns, kept in step with Redis by :meth:`round`."""

    def __init__(self, redis: Redis, replica_id: str, ttl_ms: int) -> None:
        self.redis = redis
        self.replica_id = replica_id
        self.ttl_ms = ttl_ms
        self.owned: set[str] = set()
        self.num_live_replicas = 1
        self.num_acquired = 0
        self.num_lost = 0
        self._renew = redis.register_script(RENEW_SCRIPT)
        self._release = redis.register_script(RELEASE_SCRIPT)
        self._publish = redis.register_script(PUBLISH_SCRIPT)
        self._rng = random.Random(replica_id)  # replicas try free workers in different orders

    async def round(self, known: set[str]) -> None:
        """One heartbeat: announce this replica, renew what it holds, take or give workers
        towards its fair share of ``known`` (the workers seen recently)."""
        self.num_live_replicas = await self._register()
        await self.renew()
        share = fair_share(len(known), self.num_live_replicas)
        free = await self._free(known)
        acquire, release = rebalance(self.owned, known, free, share)
        if release:
            await self.release(release)
        if acquire:
            await self._acquire(acquire)

    async def _register(self) -> int:
        now_ms = int(time.time() * 1e3)
        key = streams.CONTROL_PLANE_REPLICAS_KEY
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {self.replica_id: now_ms + self.ttl_ms})
            pipe.zremrangebyscore(key, "-inf", now_ms)
            pipe.zcard(key)
            pipe.pexpire(key, self.ttl_ms * 10)
            results: list[Any] = await pipe.execute()
        return max(1, int(results[2]))

    async def renew(self) -> None:
        """Extend every lease this replica holds; forget those it lost (expired, taken)."""
        if not self.owned:
            return
        workers = sorted(self.owned)
        keys = [streams.worker_owner_key(w) for w in workers]
        held: Any = await self._renew(keys=keys, args=[self.replica_id, self.ttl_ms])
        lost = [w for w, h in zip(workers, held, strict=True) if not int(h)]
        if lost:
            self.owned.difference_update(lost)
            self.num_lost += len(lost)
            log.warning("leases_lost", replica_id=self.replica_id, workers=lost)

    async def _free(self, known: set[str]) -> list[str]:
        """Known workers nobody holds (or held under this replica's id by an earlier
        incarnation of it, which it adopts), in this replica's own random order."""
        candidates = sorted(known - self.owned)
        if not candidates:
            return []
        values: list[Any] = await self.redis.mget([streams.worker_owner_key(w) for w in candidates])
        mine = self.replica_id.encode()
        adopted = [w for w, v in zip(candidates, values, strict=True) if v == mine]
        if adopted:
            self.owned.update(adopted)
            await self.renew()
        free = [w for w, v in zip(candidates, values, strict=True) if v is None]
        self._rng.shuffle(free)
        return free

    async def _acquire(self, workers: list[str]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker_id in workers:
                key = streams.worker_owner_key(worker_id)
                pipe.set(key, self.replica_id, nx=True, px=self.ttl_ms)
            results: list[Any] = await pipe.execute()
        taken = [w for w, ok in zip(workers, results, strict=True) if ok]
        if taken:
            self.owned.update(taken)
            self.num_acquired += len(taken)
            log.info("leases_acquired", replica_id=self.replica_id, workers=taken)

    async def release(self, workers: Iterable[str]) -> None:
        """Give ``workers`` up (deleting only leases this replica still holds)."""
        workers = sorted(workers)
        self.owned.difference_update(workers)
        if workers:
            keys = [streams.worker_owner_key(w) for w in workers]
            await self._release(keys=keys, args=[self.replica_id])
            log.info("leases_released", replica_id=self.replica_id, workers=workers)

    async def release_all(self) -> None:
        """A clean stop: every lease and the replica's entry go, so others take over now."""
        await self.release(list(self.owned))
        await self.redis.zrem(streams.CONTROL_PLANE_REPLICAS_KEY, self.replica_id)

    async def publish(self, plans: list[tuple[str, str, int, bytes]]) -> list[int]:
        """Publish (worker id, epoch, snapshot iteration, encoded plan) each through the fence,
        in one round trip: PUBLISHED, NOT_OWNER (the lease is forgotten here too) or
        ALREADY_PLANNED for each."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker_id, epoch, iteration, data in plans:
                keys = [
                    streams.worker_owner_key(worker_id),
                    streams.worker_plan_fence_key(worker_id),
                    streams.worker_plans_stream(worker_id),
                ]
                args: list[Any] = [self.replica_id, epoch, iteration, streams.MAXLEN_PLANS]
                await self._publish(keys=keys, args=[*args, data, FENCE_TTL_MS], client=pipe)
            results = [int(r) for r in await pipe.execute()]
        lost = [p[0] for p, r in zip(plans, results, strict=True) if r == NOT_OWNER]
        if lost and self.owned.intersection(lost):
            self.owned.difference_update(lost)
            self.num_lost += len(lost)
            log.warning("leases_lost_at_publish", replica_id=self.replica_id, workers=lost)
        return results
