"""SLO classes: named (TTFT, TBT) targets that a request chooses, kept in one Redis hash with a
version and validated on every write (like the knobs)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import msgpack
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from shared.errors import ConfigError
from shared.knobs import KNOB_RANGES
from shared.streams import SLO_CLASSES_KEY

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_VERSION_FIELD = "version"  # the hash's version counter, beside one field per class
# Replace every class (ARGV: name, packed spec, ...) and bump the version, in one step: two
# writers each get exactly their set, never a merge of both (a read of the fields to delete
# outside the transaction let concurrent PUTs merge). A version field that is not a number
# (written by hand) restarts from 1 rather than failing every later write.
# A script that fails is not rolled back, so nothing before DEL can fail after it (one HSET per
# field: unpack() of thousands of arguments failed after the DEL, leaving no class at all).
_REPLACE_CLASSES = f"""
local version = tonumber(redis.call('HGET', KEYS[1], '{_VERSION_FIELD}')) or 0
redis.call('DEL', KEYS[1])
for i = 1, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('HSET', KEYS[1], '{_VERSION_FIELD}', version + 1)
return version + 1
"""
# The same, only where no classes are yet (no version): 0 when some were there first.
_SEED_CLASSES = f"""
if redis.call('HEXISTS', KEYS[1], '{_VERSION_FIELD}') == 1 then
  return 0
end
{_REPLACE_CLASSES}"""
MAX_SLO_CLASSES = 256


@dataclass(frozen=True, slots=True)
class SloClass:
    name: str
    ttft_s: float
    tbt_s: float

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"SLO class name {self.name!r}: use 1-64 of [A-Za-z0-9_.-]")
        if self.name == _VERSION_FIELD:
            raise ConfigError(f"SLO class name {self.name!r} is reserved (the hash's version)")
        for field_name, value in (("ttft_s", self.ttft_s), ("tbt_s", self.tbt_s)):
            low, high = KNOB_RANGES[f"slo_{field_name}"]  # the knobs' range, as the admin API's
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"SLO class {self.name!r}: {field_name} must be a number")
            if not low <= value <= high:
                raise ConfigError(
                    f"SLO class {self.name!r}: {field_name} {value} is out of [{low:g}, {high:g}] s"
                )


DEFAULT_SLO_CLASSES: dict[str, SloClass] = {
    c.name: c
    for c in (
        SloClass("interactive", 1.0, 0.05),
        SloClass("standard", 5.0, 0.1),
        SloClass("batch", 60.0, 1.0),
    )
}


def default_class(classes: dict[str, SloClass], name: str) -> SloClass:
    """The class unclassed requests are served in: ``name``'s, else (a default that is not a
    class: mistyped, or removed with ``force``) the loosest, so that they never jump ahead of
    those that chose a class."""
    named = classes.get(name)
    if named is not None:
        return named
    return max(classes.values(), key=lambda c: (c.ttft_s, c.tbt_s))


def slo_classes_from_mapping(raw: dict[str, Any]) -> dict[str, SloClass]:
    """``{name: {"ttft_s": .., "tbt_s": ..}}`` -> validated classes (ConfigError, a ValueError,
    names the bad one)."""
    classes: dict[str, SloClass] = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict) or set(spec) != {"ttft_s", "tbt_s"}:
            raise ConfigError(f"SLO class {name!r}: give exactly ttft_s and tbt_s")
        classes[name] = SloClass(name, spec["ttft_s"], spec["tbt_s"])
    if not classes:
        raise ConfigError("at least one SLO class is needed")
    if len(classes) > MAX_SLO_CLASSES:
        raise ConfigError(f"at most {MAX_SLO_CLASSES} SLO classes, got {len(classes)}")
    return classes


async def read_slo_classes(redis: Redis) -> tuple[dict[str, SloClass], int]:
    """Current classes and version (the defaults, version 0, when none were written)."""
    raw = await redis.hgetall(SLO_CLASSES_KEY)
    try:
        version = int(raw.pop(b"version", 0))
    except ValueError:
        version = 0  # written by hand: the next write starts the count again
    if not raw:
        return dict(DEFAULT_SLO_CLASSES), version
    try:
        decoded = {_text(k): msgpack.unpackb(v) for k, v in raw.items()}
        return slo_classes_from_mapping(decoded), version
    except Exception:  # not written by us (garbage, or another version's shape)
        return dict(DEFAULT_SLO_CLASSES), version  # never written by us: keep serving


def slo_classes_write_args(raw: dict[str, Any]) -> tuple[dict[str, SloClass], list[str | bytes]]:
    """Validated classes and the arguments that write them (:func:`queue_slo_classes_write`);
    a bad value raises ValueError."""
    classes = slo_classes_from_mapping(raw)
    packed = {
        c.name: msgpack.packb({"ttft_s": float(c.ttft_s), "tbt_s": float(c.tbt_s)})
        for c in classes.values()
    }
    return classes, [part for name, spec in packed.items() for part in (name, spec)]


def queue_slo_classes_write(pipe: Pipeline, args: list[str | bytes]) -> None:
    """Queue the replacement of every class by ``args`` (from :func:`slo_classes_write_args`) in a
    transaction; its result is the new version."""
    pipe.eval(_REPLACE_CLASSES, 1, SLO_CLASSES_KEY, *args)


async def write_slo_classes(redis: Redis, raw: dict[str, Any]) -> tuple[dict[str, SloClass], int]:
    """Replace the classes with ``raw`` after validation; a bad value raises ValueError and
    nothing is written."""
    classes, args = slo_classes_write_args(raw)
    version = await redis.eval(_REPLACE_CLASSES, 1, SLO_CLASSES_KEY, *args)
    return classes, int(version)


async def seed_slo_classes(redis: Redis, raw: dict[str, Any]) -> int:
    """Write the classes ``raw`` only where Redis has none (one script: never over a write that
    came first); the new version, or 0 when classes were there."""
    _, args = slo_classes_write_args(raw)
    return int(await redis.eval(_SEED_CLASSES, 1, SLO_CLASSES_KEY, *args))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
