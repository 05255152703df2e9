"""Bearer tokens: the admin token (compared in constant time, never logged) and optional API
keys for /v1, stored in Redis only as sha256 hashes with their tenant and default SLO class.
Each gateway caches the keys it has seen (:class:`ApiKeyCache`), so a request with a key costs
no Redis round trip; every create and delete bumps a version that empties those caches."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

import msgpack
from fastapi import Request
from redis.asyncio import Redis

from gateway.errors import APIError
from shared.streams import API_KEYS_KEY

KEY_PREFIX = "sk-si-"
API_KEYS_VERSION_KEY = f"{API_KEYS_KEY}:version"  # bumped by every create and delete


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str  # the first 16 hex digits of the key's hash: safe to show and log
    tenant: str
    slo_class: str | None


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def check_admin(request: Request, admin_token: str | None) -> None:
    """401 unless the request carries the admin token."""
    given = bearer(request)
    if (
        admin_token is None
        or given is None
        or not hmac.compare_digest(given.encode(), admin_token.encode())
    ):
        raise APIError(401, "admin token missing or wrong", code="unauthorized")


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def create_api_key(redis: Redis, tenant: str, slo_class: str | None) -> tuple[str, ApiKey]:
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    digest = _hash(key)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(API_KEYS_KEY, digest, msgpack.packb({"tenant": tenant, "slo": slo_class}))
        pipe.incr(API_KEYS_VERSION_KEY)
        await pipe.execute()
    return key, ApiKey(digest[:16], tenant, slo_class)


async def delete_api_key(redis: Redis, key_id: str) -> bool:
    for digest in await redis.hkeys(API_KEYS_KEY):
        text = digest.decode() if isinstance(digest, bytes) else digest
        if text.startswith(key_id) and len(key_id) >= 8:
            async with redis.pipeline(transaction=True) as pipe:
                pipe.hdel(API_KEYS_KEY, text)
                pipe.incr(API_KEYS_VERSION_KEY)
                deleted, _ = await pipe.execute()
            return bool(deleted)
    return False


def _parse(digest: str, raw: bytes | str | None) -> ApiKey | None:
    if raw is None:
        return None
    try:
        data = msgpack.unpackb(raw)
        return ApiKey(digest[:16], str(data["tenant"]), data.get("slo"))
    except (ValueError, KeyError, TypeError):
        return None


class ApiKeyCache:
    """The API keys this gateway has seen, by hash. A known key costs no Redis round trip; an
    unknown one is looked up every time (so a key created through another gateway works at
    once). :meth:`refresh` (with the worker directory's) empties the cache when the keys'
    version changed: a key deleted anywhere stops working within one refresh, at once on the
    gateway that deleted it."""

    def __init__(self, redis: Redis, max_keys: int = 65_536) -> None:
        self.redis = redis
        self.max_keys = max_keys
        self._keys: dict[str, ApiKey] = {}
        self._version: bytes | str | None = None
        self._generation = 0  # bumped whenever the cache empties

    async def lookup(self, key: str) -> ApiKey | None:
        digest = _hash(key)
        known = self._keys.get(digest)
        if known is not None:
            return known
        generation = self._generation
        info = _parse(digest, await self.redis.hget(API_KEYS_KEY, digest))
        if info is not None and generation == self._generation:  # not emptied meanwhile
            if len(self._keys) >= self.max_keys:
                self._keys.clear()
            self._keys[digest] = info
        return info

    async def refresh(self) -> None:
        version = await self.redis.get(API_KEYS_VERSION_KEY)
        if version != self._version:
            self._version = version
            self.clear()

    def clear(self) -> None:
        self._keys.clear()
        self._generation += 1
