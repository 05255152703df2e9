"""The SLO knobs in Redis, their one source: one hash with a version, validated on every write.
Every write is atomic: an update is a WATCH/MULTI/EXEC retried when another write came between
(none is lost), a service's flags seed the knobs with one script only where Redis has none."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError, WatchError

from shared.policy import POLICY_NAMES, Knobs
from shared.streams import KNOBS_KEY

_FLOAT_FIELDS = {"alpha", "beta_b", "beta_f", "slo_ttft_s", "slo_tbt_s", "min_residency_s"}
_BOOL_FIELDS = {
    "rotate_only_for_lag",
    "protect_unserved",
    "hold_room_for_rotary",
    "adaptive_residency",
}
_BOOL_TEXT = {"true": True, "1": True, "false": False, "0": False}


def knobs_from_mapping(raw: dict[str, Any], base: Knobs | None = None) -> Knobs:
    """Build validated knobs from strings/values; raises ValueError naming the bad knob."""
    values = asdict(base or Knobs())
    names = {f.name for f in fields(Knobs)}
    for key, value in raw.items():
        if key == "version":
            continue
        if key not in names:
            raise ValueError(f"unknown knob {key!r}")
        values[key] = _parse(key, value)
    if values["policy"] not in POLICY_NAMES:
        raise ValueError(f"knob 'policy': {values['policy']!r} is not one of {POLICY_NAMES}")
    return Knobs(**values)


def _parse(key: str, value: Any) -> Any:
    if isinstance(value, bytes):
        value = value.decode()
    try:
        if key in _FLOAT_FIELDS:
            return float(value)
        if key in _BOOL_FIELDS:
            return _parse_bool(value)
        if key == "b_xfer":
            return None if value in (None, "auto", "") else int(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"knob {key!r}: {value!r} is not a valid value") from exc
    return str(value)


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _BOOL_TEXT:
        return _BOOL_TEXT[value.lower()]
    raise ValueError(f"{value!r} is not a boolean")


def knobs_to_mapping(knobs: Knobs) -> dict[str, str]:
    return {k: ("auto" if v is None else str(v)) for k, v in asdict(knobs).items()}


# HSET the knobs (ARGV: field, value, ...) and version 1 into KEYS[1] unless it has a version;
# either way the hash as it then is, flat.
_SEED_IF_ABSENT = """
if redis.call('HEXISTS', KEYS[1], 'version') == 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV))
  redis.call('HINCRBY', KEYS[1], 'version', 1)
end
return redis.call('HGETALL', KEYS[1])
"""
MAX_WRITE_ATTEMPTS = 1000  # WATCH retries of one update (each retry means another write won)


def _decoded(raw: dict[Any, Any]) -> tuple[Knobs, int]:
    decoded = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
    version = int(decoded.get("version", 0))
    known = {f.name for f in fields(Knobs)}  # a newer writer's extra knobs are not ours to read
    return knobs_from_mapping({k: v for k, v in decoded.items() if k in known}), version


async def read_knobs(redis: Redis) -> tuple[Knobs, int]:
    """Current knobs and version (defaults, version 0, when none were written)."""
    return _decoded(await redis.hgetall(KNOBS_KEY))


async def write_knobs(redis: Redis, changes: dict[str, Any]) -> tuple[Knobs, int]:
    """Validate ``changes`` against the current knobs, then store them with version + 1, in
    one transaction that is retried when the knobs changed meanwhile (a concurrent update is
    never lost). A bad value raises ValueError and nothing is written."""
    async with redis.pipeline(transaction=True) as pipe:
        for _ in range(MAX_WRITE_ATTEMPTS):
            try:
                await pipe.watch(KNOBS_KEY)
                current, _ = _decoded(await pipe.hgetall(KNOBS_KEY))
                updated = knobs_from_mapping(changes, current)
                mapping: dict[Any, Any] = knobs_to_mapping(updated)
                pipe.multi()
                pipe.hset(KNOBS_KEY, mapping=mapping)
                pipe.hincrby(KNOBS_KEY, "version", 1)
                _, version = await pipe.execute()
                return updated, int(version)
            except WatchError:
                continue
    raise RedisError(f"the knobs changed under {MAX_WRITE_ATTEMPTS} attempts to update them")


async def seed_knobs(redis: Redis, knobs: Knobs) -> tuple[Knobs, int]:
    """Store ``knobs`` (version 1) only where Redis has none, atomically; returns the knobs in
    force and their version, ``knobs`` or what was there (ValueError when that is invalid)."""
    flat = [item for pair in knobs_to_mapping(knobs).items() for item in pair]
    raw: list[Any] = await redis.eval(_SEED_IF_ABSENT, 1, KNOBS_KEY, *flat)
    return _decoded(dict(zip(raw[::2], raw[1::2], strict=True)))
