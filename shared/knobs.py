"""The SLO knobs in Redis: one hash with a version, validated on every write."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from redis.asyncio import Redis

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


async def read_knobs(redis: Redis) -> tuple[Knobs, int]:
    """Current knobs and version (defaults, version 0, when none were written)."""
    raw = await redis.hgetall(KNOBS_KEY)
    decoded = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
    version = int(decoded.get("version", 0))
    known = {f.name for f in fields(Knobs)}  # a newer writer's extra knobs are not ours to read
    return knobs_from_mapping({k: v for k, v in decoded.items() if k in known}), version


async def write_knobs(redis: Redis, changes: dict[str, Any]) -> tuple[Knobs, int]:
    """Validate ``changes`` against the current knobs, then store them with version + 1.
    A bad value raises ValueError and nothing is written."""
    current, _ = await read_knobs(redis)
    updated = knobs_from_mapping(changes, current)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(KNOBS_KEY, mapping=dict(knobs_to_mapping(updated)))  # type: ignore[arg-type]
        pipe.hincrby(KNOBS_KEY, "version", 1)
        _, version = await pipe.execute()
    return updated, int(version)
