"""The SLO knobs in Redis, their one source: one hash with a version, validated on every write.
Every write is atomic: an update is a WATCH/MULTI/EXEC retried when another write came between
(none is lost), a service's flags seed the knobs with one script only where Redis has none.

Each numeric knob has a range (:data:`KNOB_RANGES`, docs/tuning.md "Ranges"): wide enough for
any real deployment, narrow enough that nothing the policy or the wire computes from it
overflows (a ``b_xfer`` of 1e23 made every plan fail to encode). A boolean is no number here
and a ``b_xfer`` must be a whole number. ``b_xfer`` None is stored as "auto", ``demote_late_s``
None as "off"."""

from __future__ import annotations

import math
from dataclasses import asdict, fields
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError, WatchError

from shared.errors import ConfigError
from shared.policy import POLICY_NAMES, Knobs
from shared.streams import KNOBS_KEY

_FLOAT_FIELDS = {
    "alpha",
    "beta_b",
    "beta_f",
    "slo_ttft_s",
    "slo_tbt_s",
    "min_residency_s",
    "tpot_headroom_s",
}
_BOOL_FIELDS = {
    "rotate_only_for_lag",
    "protect_unserved",
    "hold_room_for_rotary",
    "adaptive_residency",
    "tenant_fairness",
    "deadline_lag",
    "residency_yields_to_tighter",
    "lag_per_block",
    "tpot_lag",
}
# Optional knobs' text for None (b_xfer: auto, the link's measure; demote_late_s and
# max_pause_s: off)
_NONE_TEXT = {"b_xfer": "auto", "demote_late_s": "off", "max_pause_s": "off"}
_BOOL_TEXT = {"true": True, "1": True, "false": False, "0": False}
MAX_B_XFER_BLOCKS = 2**31 - 1  # blocks per iteration: 4 TB/s for 1 s in 2 KB blocks
# (low, high), inclusive. Times: up to a day. Multipliers of a lag or an SLO: far beyond the
# measured best values (alpha 1-12, beta -0.5-2) and still finite when multiplied by a day.
KNOB_RANGES: dict[str, tuple[float, float]] = {
    "alpha": (0.0, 1e4),
    "beta_b": (-1e3, 1e3),
    "beta_f": (-1e3, 1e3),
    "slo_ttft_s": (1e-3, 86_400.0),
    "slo_tbt_s": (1e-3, 86_400.0),
    "min_residency_s": (0.0, 86_400.0),
    "tpot_headroom_s": (0.0, 86_400.0),
    "b_xfer": (1, MAX_B_XFER_BLOCKS),  # 0 would strand copies already queued
    "demote_late_s": (0.0, 86_400.0),
    "max_pause_s": (1e-3, 86_400.0),
}


class KnobError(ConfigError):
    """A knob's value (or name) that is not valid; ``knob`` is its name."""

    def __init__(self, knob: str, message: str) -> None:
        super().__init__(message)
        self.knob = knob


def knobs_from_mapping(raw: dict[str, Any], base: Knobs | None = None) -> Knobs:
    """Build validated knobs from strings/values; raises KnobError naming the bad knob."""
    values = asdict(base or Knobs())
    names = {f.name for f in fields(Knobs)}
    for key, value in raw.items():
        if key not in names:
            raise KnobError(str(key)[:64], f"unknown knob {_shown(key)}")
        values[key] = _parse(key, value)
    if values["policy"] not in POLICY_NAMES:
        message = f"knob 'policy': {_shown(values['policy'])} is not one of {POLICY_NAMES}"
        raise KnobError("policy", message)
    return Knobs(**values)


def _parse(key: str, value: Any) -> Any:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    try:
        if key in _FLOAT_FIELDS:
            return _in_range(key, _number(value))
        if key in _BOOL_FIELDS:
            return _parse_bool(value)
        if key in _NONE_TEXT:  # "auto" / "off" in any case, as the services' settings take them
            if value is None or (isinstance(value, str) and value.lower() in ("", _NONE_TEXT[key])):
                return None
            parse = _whole if key == "b_xfer" else _number
            return _in_range(key, parse(value))
    except (TypeError, ValueError, OverflowError) as exc:
        message = f"knob {key!r}: {_shown(value)} is not a valid value ({_cut(str(exc))})"
        raise KnobError(key, message) from exc
    if not isinstance(value, str):
        raise KnobError(key, f"knob {key!r}: {_shown(value)} is not a string")
    return value


def _number(value: Any) -> float:
    """A finite number from a JSON number or its text (Redis holds text); never a boolean."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"a number is needed, not {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError("not a finite number")
    return number


def _whole(value: Any) -> int:
    """A whole number from an integer, an integral float (1e3) or their text."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number = _number(value)
    if not number.is_integer():
        raise ValueError("not a whole number")
    return int(number)


def _in_range(key: str, number: Any) -> Any:
    low, high = KNOB_RANGES[key]
    if not low <= number <= high:
        raise ValueError(f"out of range [{low:g}, {high:g}]")
    return number


def _shown(value: Any) -> str:
    return _cut(repr(value))


def _cut(text: str, limit: int = 64) -> str:
    """``text`` as an error message echoes it: at most ``limit`` characters and "..."."""
    return text if len(text) <= limit else f"{text[:limit]}..."


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _BOOL_TEXT:
        return _BOOL_TEXT[value.lower()]
    raise ValueError(f"{value!r} is not a boolean")


def knobs_to_mapping(knobs: Knobs) -> dict[str, str]:
    """As Redis stores them: text."""
    return {k: (_NONE_TEXT[k] if v is None else str(v)) for k, v in asdict(knobs).items()}


def knobs_to_json(knobs: Knobs) -> dict[str, Any]:
    """As the admin API shows them: numbers, booleans and names (``"auto"`` / ``"off"`` for
    the knobs that take them), which :func:`knobs_from_mapping` reads back."""
    return {k: (_NONE_TEXT[k] if v is None else v) for k, v in asdict(knobs).items()}


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


def _stored(raw: dict[Any, Any]) -> tuple[dict[str, Any], int]:
    """The hash's knobs (as stored, unvalidated) and version."""
    decoded = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
    version = int(decoded.get("version", 0))
    known = {f.name for f in fields(Knobs)}  # a newer writer's extra knobs are not ours to read
    return {k: v for k, v in decoded.items() if k in known}, version


def _texts(stored: dict[str, Any]) -> dict[str, str]:
    return {k: (v.decode() if isinstance(v, bytes) else str(v)) for k, v in stored.items()}


def _decoded(raw: dict[Any, Any]) -> tuple[Knobs, int]:
    stored, version = _stored(raw)
    return knobs_from_mapping(stored), version


async def read_knobs(redis: Redis) -> tuple[Knobs, int]:
    """Current knobs and version (defaults, version 0, when none were written)."""
    return _decoded(await redis.hgetall(KNOBS_KEY))


async def write_knobs(redis: Redis, changes: dict[str, Any]) -> tuple[Knobs, int]:
    """Validate ``changes`` against the current knobs, then store them with version + 1 (a
    change to the values they hold already: no write, the version stays), in one transaction
    that is retried when the knobs changed meanwhile (a concurrent update is never lost). A
    bad value raises ValueError and nothing is written. ``changes`` are validated over the
    stored values, so an update that replaces a stored value out of range (written before
    its range existed) repairs it, and one that does not names it."""
    async with redis.pipeline(transaction=True) as pipe:
        for _ in range(MAX_WRITE_ATTEMPTS):
            try:
                await pipe.watch(KNOBS_KEY)
                current, stored_version = _stored(await pipe.hgetall(KNOBS_KEY))
                updated = knobs_from_mapping({**current, **changes})
                mapping: dict[Any, Any] = knobs_to_mapping(updated)
                if stored_version and _texts(current) == mapping:  # no change: no new version
                    await pipe.unwatch()
                    return updated, stored_version
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
