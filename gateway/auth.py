"""Bearer tokens: the admin token (compared in constant time, never logged) and optional API
keys for /v1, stored in Redis only as sha256 hashes with their tenant, SLO class (a ceiling:
see :mod:`gateway.tenancy`) and lowest priority. Each gateway caches the keys it has seen and,
for a short TTL, the ones it found unknown (:class:`ApiKeyCache`), so a repeated key costs no
Redis round trip, and a token that is not of our keys' shape none at all; every create and
delete bumps a version that empties those caches."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

import msgpack
from fastapi import Request
from redis.asyncio import Redis
from redis.exceptions import RedisError, WatchError

from gateway.errors import APIError
from shared.knobs import MAX_WRITE_ATTEMPTS
from shared.slo import read_slo_classes
from shared.streams import API_KEYS_KEY, API_KEYS_VERSION_KEY, SLO_CLASSES_KEY

KEY_PREFIX = "sk-si-"
MAX_KEY_CHARS = 256  # ours are 49; a longer token is never looked up
KEY_ID_CHARS = 16


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str  # the first 16 hex digits of the key's hash: safe to show and log
    tenant: str
    slo_class: str | None
    min_priority: int = 0  # the lowest (first-served) priority its requests may ask for


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def carries(request: Request, token: str | None) -> bool:
    """Whether the request's bearer is ``token`` (compared in constant time)."""
    given = bearer(request)
    return (
        token is not None
        and given is not None
        and hmac.compare_digest(given.encode(), token.encode())
    )


def check_admin(request: Request, admin_token: str | None) -> None:
    """401 unless the request carries the admin token."""
    if not carries(request, admin_token):
        raise APIError(401, "admin token missing or wrong", code="unauthorized")


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class UnknownSloClassError(ValueError):
    """A key names an SLO class that is not stored."""


async def create_api_key(
    redis: Redis, tenant: str, slo_class: str | None, min_priority: int = 0
) -> tuple[str, ApiKey]:
    """Store a new key; one naming an SLO class is stored only while that class is (the
    classes are watched: a replacement that removes it meanwhile retries the check), else
    :class:`UnknownSloClassError`."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    digest = _hash(key)
    record = {"tenant": tenant, "slo": slo_class, "prio": min_priority}
    async with redis.pipeline(transaction=True) as pipe:
        for _ in range(MAX_WRITE_ATTEMPTS):
            try:
                await pipe.watch(SLO_CLASSES_KEY)
                if slo_class is not None and slo_class not in (await read_slo_classes(pipe))[0]:
                    raise UnknownSloClassError(f"unknown SLO class {slo_class!r}")
                pipe.multi()
                pipe.hset(API_KEYS_KEY, digest, msgpack.packb(record))
                pipe.incr(API_KEYS_VERSION_KEY)
                await pipe.execute()
                return key, ApiKey(digest[:KEY_ID_CHARS], tenant, slo_class, min_priority)
            except WatchError:
                continue
    raise RedisError(f"the SLO classes changed under {MAX_WRITE_ATTEMPTS} attempts to add a key")


async def stored_key_ids(redis: Redis) -> set[str]:
    """The ids of every stored key."""
    digests = await redis.hkeys(API_KEYS_KEY)
    return {(d.decode() if isinstance(d, bytes) else d)[:KEY_ID_CHARS] for d in digests}


def is_key_id(text: str) -> bool:
    """Whether ``text`` is a whole key id: exactly the 16 lowercase hex digits we hand out."""
    return len(text) == KEY_ID_CHARS and all(c in "0123456789abcdef" for c in text)


async def delete_api_key(redis: Redis, key_id: str) -> bool:
    """Delete the key whose id is ``key_id``, a whole id (a shorter prefix matches nothing);
    False when there is none."""
    if not is_key_id(key_id):
        return False
    for digest in await redis.hkeys(API_KEYS_KEY):
        text = digest.decode() if isinstance(digest, bytes) else digest
        if text[:KEY_ID_CHARS] == key_id:
            async with redis.pipeline(transaction=True) as pipe:
                pipe.hdel(API_KEYS_KEY, text)
                pipe.incr(API_KEYS_VERSION_KEY)
                deleted, _ = await pipe.execute()
            return bool(deleted)
    return False


async def keys_by_class(redis: Redis) -> dict[str | None, list[str]]:
    """The ids of every stored key by the SLO class it names (None: no class, the default)."""
    found: dict[str | None, list[str]] = {}
    for digest, raw in (await redis.hgetall(API_KEYS_KEY)).items():
        text = digest.decode() if isinstance(digest, bytes) else digest
        info = _parse(text, raw)
        if info is not None:
            found.setdefault(info.slo_class, []).append(info.key_id)
    return found


def _parse(digest: str, raw: bytes | str | None) -> ApiKey | None:
    if raw is None:
        return None
    try:
        data = msgpack.unpackb(raw)
        slo, prio = data.get("slo"), int(data.get("prio", 0))
        return ApiKey(digest[:KEY_ID_CHARS], str(data["tenant"]), slo, prio)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class ApiKeyCache:
    """The API keys this gateway has seen, by hash, and the unknown ones for ``miss_ttl_s``
    (at most ``max_misses``, the oldest forgotten first). A known key costs no Redis round
    trip, nor does an unknown one seen within its TTL, nor a token not shaped like our keys.
    :meth:`refresh` (with the worker directory's) empties both when the keys' version changed:
    a key deleted anywhere stops working within one refresh, at once on the gateway that
    deleted it, and a key created anywhere works within one refresh even where its hash was a
    remembered miss (a fresh key is random: no one could have tried it before)."""

    def __init__(
        self,
        redis: Redis,
        max_keys: int = 65_536,
        miss_ttl_s: float = 10.0,
        max_misses: int = 65_536,
    ) -> None:
        self.redis = redis
        self.max_keys = max_keys
        self.miss_ttl_s = miss_ttl_s
        self.max_misses = max_misses
        self._keys: dict[str, ApiKey] = {}
        self._misses: dict[str, float] = {}  # hash -> monotonic time it is forgotten at
        self._version: bytes | str | None = None
        self._generation = 0  # bumped whenever the cache empties

    async def lookup(self, key: str) -> ApiKey | None:
        if not key.startswith(KEY_PREFIX) or len(key) > MAX_KEY_CHARS:
            return None  # not one of ours: no round trip
        digest = _hash(key)
        known = self._keys.get(digest)
        if known is not None:
            return known
        if self._misses.get(digest, 0.0) > time.monotonic():
            return None
        generation = self._generation
        info = _parse(digest, await self.redis.hget(API_KEYS_KEY, digest))
        if generation != self._generation:  # emptied meanwhile: remember nothing
            return info
        if info is not None:
            if len(self._keys) >= self.max_keys:
                self._keys.clear()
            self._keys[digest] = info
        else:
            self._remember_miss(digest)
        return info

    def _remember_miss(self, digest: str) -> None:
        if self.miss_ttl_s <= 0 or self.max_misses <= 0:
            return
        self._misses.pop(digest, None)
        while len(self._misses) >= self.max_misses:
            del self._misses[next(iter(self._misses))]  # the oldest
        self._misses[digest] = time.monotonic() + self.miss_ttl_s

    @property
    def num_misses(self) -> int:
        return len(self._misses)

    async def refresh(self) -> bool:
        """Forget what was cached when the keys changed; returns whether they did (the first
        refresh after a start counts: keys may have gone while this gateway was down)."""
        version = await self.redis.get(API_KEYS_VERSION_KEY)
        if version == self._version:
            return False
        self._version = version
        self.clear()
        return True

    def clear(self) -> None:
        self._keys.clear()
        self._misses.clear()
        self._generation += 1
