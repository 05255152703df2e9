"""SLO classes in Redis: a write replaces the whole set in one step (concurrent writers each
leave exactly their set, never a merge), and the version's field is not a class name."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from shared.slo import (
    read_slo_classes,
    seed_slo_classes,
    slo_classes_from_mapping,
    write_slo_classes,
)
from shared.streams import SLO_CLASSES_KEY

SPEC = {"ttft_s": 1.0, "tbt_s": 0.1}


async def test_concurrent_writes_leave_one_writers_set(redis_client: Redis) -> None:
    """The fields to delete were read outside the transaction: 10 of 40 concurrent PUTs from
    two gateways left {standard, x1, y2}, a set neither asked for."""
    versions = []
    for round_ in range(40):
        first = {"standard": SPEC, f"x{round_}": SPEC}
        second = {"standard": SPEC, f"y{round_}": SPEC}
        results = await asyncio.gather(
            write_slo_classes(redis_client, first), write_slo_classes(redis_client, second)
        )
        classes, version = await read_slo_classes(redis_client)
        assert set(classes) in (set(first), set(second))
        assert sorted(v for _, v in results) == [version - 1, version]
        versions.append(version)
    assert versions == sorted(versions) and len(set(versions)) == 40


async def test_a_seed_never_writes_over_classes_written_first(redis_client: Redis) -> None:
    """Two control planes starting on an empty Redis and an admin's PUT race: exactly one
    seed writes, and no seed replaces the classes once some are there."""
    await redis_client.delete(SLO_CLASSES_KEY)
    results = await asyncio.gather(
        *(seed_slo_classes(redis_client, {"standard": SPEC, f"s{i}": SPEC}) for i in range(8))
    )
    assert sorted(results) == [0] * 7 + [1]
    (winner,) = [i for i, version in enumerate(results) if version]
    await write_slo_classes(redis_client, {"standard": SPEC, "admin": SPEC})
    assert await seed_slo_classes(redis_client, {"standard": SPEC, "late": SPEC}) == 0
    classes, version = await read_slo_classes(redis_client)
    assert set(classes) == {"standard", "admin"} and version == 2 and winner >= 0


async def test_version_is_not_a_class_name_and_a_bad_version_heals(redis_client: Redis) -> None:
    """A class named "version" overwrote the counter with msgpack: every later read and write
    of the classes failed until the key was deleted by hand."""
    with pytest.raises(ValueError, match="reserved"):
        slo_classes_from_mapping({"version": SPEC, "standard": SPEC})
    await redis_client.hset(SLO_CLASSES_KEY, "version", "not a number")
    assert (await read_slo_classes(redis_client))[1] == 0
    classes, version = await write_slo_classes(redis_client, {"standard": SPEC})
    assert set(classes) == {"standard"} and version == 1


async def test_a_refused_write_leaves_the_classes_as_they_were(redis_client: Redis) -> None:
    """4,000 classes failed inside the script after its DEL (unpack's limit): every class was
    gone. Now the count is bounded before anything is written, and 256 are written whole."""
    await write_slo_classes(redis_client, {"gold": SPEC})
    with pytest.raises(ValueError, match="at most 256"):
        await write_slo_classes(redis_client, {f"c{i}": SPEC for i in range(4000)})
    classes, _ = await read_slo_classes(redis_client)
    assert set(classes) == {"gold"}
    many = {f"c{i}": SPEC for i in range(256)}
    assert set((await write_slo_classes(redis_client, many))[0]) == set(many)
    assert len((await read_slo_classes(redis_client))[0]) == 256
