"""Bearer tokens: the admin token (compared in constant time, never logged) and optional API
keys for /v1, stored in Redis only as sha256 hashes with their tenant and default SLO class."""

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
    await redis.hset(API_KEYS_KEY, digest, msgpack.packb({"tenant": tenant, "slo": slo_class}))
    return key, ApiKey(digest[:16], tenant, slo_class)


async def delete_api_key(redis: Redis, key_id: str) -> bool:
    for digest in await redis.hkeys(API_KEYS_KEY):
        text = digest.decode() if isinstance(digest, bytes) else digest
        if text.startswith(key_id) and len(key_id) >= 8:
            return bool(await redis.hdel(API_KEYS_KEY, text))
    return False


async def lookup_api_key(redis: Redis, key: str) -> ApiKey | None:
    digest = _hash(key)
    raw = await redis.hget(API_KEYS_KEY, digest)
    if raw is None:
        return None
    try:
        data = msgpack.unpackb(raw)
        return ApiKey(digest[:16], str(data["tenant"]), data.get("slo"))
    except (ValueError, KeyError, TypeError):
        return None
