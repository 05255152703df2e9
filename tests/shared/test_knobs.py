"""The knobs in Redis (shared/knobs.py): concurrent updates are never lost (each commits in
its own version, over every earlier one), a bad value writes nothing, seeding writes only
where Redis has none and every seeder gets the knobs in force."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from redis.asyncio import Redis

from shared.knobs import knobs_from_mapping, read_knobs, seed_knobs, write_knobs
from shared.policy import Knobs
from shared.streams import KNOBS_KEY

# Knobs whose every value 1 + i is valid: update i sets one of them to its own value.
FIELDS = ("alpha", "beta_b", "beta_f", "slo_ttft_s", "slo_tbt_s", "min_residency_s", "b_xfer")


def update(index: int) -> dict[str, Any]:
    """The ``index``-th update: one knob, a value no other update writes."""
    name = FIELDS[index % len(FIELDS)]
    return {name: 1 + index if name == "b_xfer" else 1.0 + index}


def assert_serial(
    base: Knobs, base_version: int, updates: list[dict[str, Any]], results: list[tuple[Knobs, int]]
) -> None:
    """Each update committed in its own version after ``base_version``, on top of every one
    committed before it: replaying them in version order gives what each writer got back."""
    versions = sorted(version for _, version in results)
    assert versions == list(range(base_version + 1, base_version + len(updates) + 1))
    expected = base
    for changes, (knobs, _) in sorted(zip(updates, results, strict=True), key=lambda p: p[1][1]):
        expected = knobs_from_mapping(changes, expected)
        assert knobs == expected  # nothing lost before it


async def test_50_concurrent_updates_are_never_lost(redis_client: Redis) -> None:
    base, base_version = await write_knobs(redis_client, {"policy": "lvf"})
    updates = [update(i) for i in range(50)]
    results = await asyncio.gather(*(write_knobs(redis_client, u) for u in updates))
    assert_serial(base, base_version, updates, results)
    final, version = await read_knobs(redis_client)
    assert version == base_version + 50
    assert final == max(results, key=lambda r: r[1])[0]
    for name in FIELDS:  # each knob holds the value of the last update that wrote it
        last = max(
            (r for u, r in zip(updates, results, strict=True) if name in u), key=lambda r: r[1]
        )
        assert getattr(final, name) == getattr(last[0], name)
    assert final.policy == "lvf"  # written before, kept by all 50


async def test_a_bad_update_writes_nothing(redis_client: Redis) -> None:
    before = await write_knobs(redis_client, {"alpha": 2.0})
    with pytest.raises(ValueError, match="alpha"):
        await write_knobs(redis_client, {"alpha": -1, "beta_f": 0.7})
    assert await read_knobs(redis_client) == before


async def test_an_update_to_the_values_in_force_keeps_the_version(redis_client: Redis) -> None:
    """Workers drop plans made under another version: a PUT that changes nothing bumped it."""
    _, version = await write_knobs(redis_client, {"alpha": 3.0, "b_xfer": "auto"})
    for same in ({"alpha": 3.0}, {"alpha": "3"}, {"b_xfer": "AUTO"}, {"alpha": 3, "b_xfer": None}):
        assert (await write_knobs(redis_client, same))[1] == version, same
    assert (await write_knobs(redis_client, {"alpha": 2.5}))[1] == version + 1


async def test_refusals_echo_at_most_a_short_cut_of_the_input() -> None:
    for changes in ({"k" * 100_000: 1}, {"policy": "p" * 100_000}, {"alpha": "9" * 100_000 + "x"}):
        with pytest.raises(ValueError) as refused:
            knobs_from_mapping(changes)
        assert len(str(refused.value)) < 400, changes.keys()


async def test_the_version_is_not_a_knob_to_write(redis_client: Redis) -> None:
    """``{"version": ...}`` would change nothing yet bump the version (workers drop their
    plans): refused, naming it."""
    before = await write_knobs(redis_client, {"alpha": 2.0})
    with pytest.raises(ValueError, match="'version'"):
        await write_knobs(redis_client, {"version": "banana"})
    assert await read_knobs(redis_client) == before


async def test_seeding_writes_only_where_redis_has_none(redis_client: Redis) -> None:
    flags = Knobs(policy="lvf", b_xfer=64)
    assert await seed_knobs(redis_client, flags) == (flags, 1)
    assert await read_knobs(redis_client) == (flags, 1)
    assert await seed_knobs(redis_client, Knobs(policy="vllm")) == (flags, 1)  # not over it
    updated, version = await write_knobs(redis_client, {"alpha": 2.0})
    assert (
        await seed_knobs(redis_client, Knobs())
        == (updated, version)
        == (
            dataclasses.replace(flags, alpha=2.0),
            2,
        )
    )


async def test_concurrent_seeders_agree_on_one(redis_client: Redis) -> None:
    seeds = [
        Knobs(policy=p, b_xfer=i + 1) for i, p in enumerate(["lvf", "vllm", "edf", "swap"] * 5)
    ]
    results = await asyncio.gather(*(seed_knobs(redis_client, s) for s in seeds))
    (in_force,) = set(results)
    assert in_force[1] == 1 and in_force[0] in seeds
    assert await read_knobs(redis_client) == in_force


async def test_seeding_over_invalid_knobs_raises_and_writes_nothing(redis_client: Redis) -> None:
    await redis_client.hset(KNOBS_KEY, mapping={"policy": "nope", "version": 3})
    with pytest.raises(ValueError, match="policy"):
        await seed_knobs(redis_client, Knobs(policy="lvf"))
    assert await redis_client.hget(KNOBS_KEY, "policy") == b"nope"
