"""The knobs and SLO classes survive a Redis that lost them (restarted without persistence, a
FLUSHDB, a failover to an empty replica): the control plane keeps the last version of each hash
it saw and, when the hash is gone, writes it back as it was, version included, so that workers
and gateways holding that version change nothing. It writes only into an absent hash (one
script: never over an admin's write that came first). The control plane owns this because it
is the one service that polls both hashes (gateways write them through the admin API, a
worker seeds the knobs into an empty Redis, ``serve --policy`` sets the policy). With several
replicas each keeps its own copy and the first to see the loss restores it: a change made
within one poll (``knobs_poll_s``) before the loss may be one that replica had not seen yet.
A control plane started after the loss writes its configured ones (``SUPERINFER_KNOBS`` /
``SUPERINFER_SLO_CLASSES``) instead."""

from __future__ import annotations

from typing import Any

import structlog
from redis.asyncio import Redis

from shared.knobs import read_knobs
from shared.slo import read_slo_classes
from shared.streams import KNOBS_KEY, SLO_CLASSES_KEY

log = structlog.get_logger(__name__)

# HSET the saved fields into KEYS[1] only if it does not exist; 1 when written.
_WRITE_IF_ABSENT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


class ConfigKeeper:
    KEYS = (KNOBS_KEY, SLO_CLASSES_KEY)

    def __init__(self) -> None:
        self._saved: dict[str, dict[bytes, bytes]] = {}  # key -> its fields, version included

    async def check(self, redis: Redis) -> None:
        """One poll (two small HGETALLs): save a hash that changed once it reads back valid,
        restore one that disappeared (raises RedisError)."""
        async with redis.pipeline(transaction=False) as pipe:
            for key in self.KEYS:
                pipe.hgetall(key)
            hashes: list[Any] = await pipe.execute()
        for key, fields in zip(self.KEYS, hashes, strict=True):
            saved = self._saved.get(key)
            if not fields and saved is not None:
                await self._restore(redis, key)
            elif b"version" in fields and fields != saved:
                await self._save(redis, key, fields)

    async def _save(self, redis: Redis, key: str, fields: dict[bytes, bytes]) -> None:
        try:  # what a reader would get: never save (and later restore) an invalid hash
            await (read_knobs(redis) if key == KNOBS_KEY else read_slo_classes(redis))
        except ValueError as exc:
            log.error("config_not_saved", key=key, error=str(exc))
            return
        self._saved[key] = fields

    async def _restore(self, redis: Redis, key: str) -> None:
        saved = self._saved[key]
        flat = [item for pair in saved.items() for item in pair]
        written = await redis.eval(_WRITE_IF_ABSENT, 1, key, *flat)
        version = int(saved[b"version"])
        if written:
            log.warning("config_restored", key=key, version=version)
        else:
            log.info("config_not_restored_written_meanwhile", key=key, version=version)
