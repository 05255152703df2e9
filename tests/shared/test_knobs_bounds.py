"""The knobs' ranges (shared/knobs.py KNOB_RANGES): each bound is accepted and an LVF plan made
with every knob at its bound encodes onto the wire; beyond a bound, non-finite, a boolean, a
list or a fractional ``b_xfer`` is a ValueError naming the knob; a stored value out of range
(from before the ranges) is repaired by a write that replaces it."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from shared.knobs import (
    KNOB_RANGES,
    knobs_from_mapping,
    knobs_to_mapping,
    read_knobs,
    write_knobs,
)
from shared.policy import make_plan
from shared.protocol import RotationPlan, decode, encode
from shared.streams import KNOBS_KEY
from tests.shared.policy_views import rotary, running, snap, waiting

# The values: each made an LVF service log OverflowError every 2 s.
ABSURD: list[dict[str, Any]] = [
    {"b_xfer": 1e23},
    {"b_xfer": 10**23},
    {"alpha": 1e300},
    {"min_residency_s": 1e308},
    {"slo_tbt_s": 1e-300},
    {"beta_b": -1e300},
    {"demote_late_s": 1e300},
    {"demote_late_s": -1.0},
]


@pytest.mark.parametrize(
    "changes", ABSURD, ids=lambda c: f"{next(iter(c))}={next(iter(c.values()))}"
)
def test_absurd_values_are_refused(changes: dict[str, Any]) -> None:
    (name,) = changes
    with pytest.raises(ValueError, match=f"knob '{name}'.*out of range"):
        knobs_from_mapping(changes)


@pytest.mark.parametrize(
    "changes",
    [
        {"alpha": True},
        {"alpha": [1]},
        {"alpha": {"x": 1}},
        {"alpha": "nan"},
        {"alpha": float("inf")},
        {"alpha": 10**400},
        {"b_xfer": 2.5},
        {"b_xfer": False},
        {"b_xfer": [64]},
        {"policy": ["lvf"]},
        {"policy": 1},
        {"rotate_only_for_lag": 2},
        {"deadline_lag": "sometimes"},
        {"demote_late_s": "auto"},
        {"demote_late_s": True},
    ],
    ids=repr,
)
def test_wrong_types_are_refused(changes: dict[str, Any]) -> None:
    (name,) = changes
    with pytest.raises(ValueError, match=f"knob '{name}'"):
        knobs_from_mapping(changes)


def test_every_bound_is_accepted_and_plans_with_it_encode() -> None:
    views = (
        running("r1", t_run=1.0, blocks=4),
        running("r2", t_run=2.0, blocks=4),
        waiting("w", t_arr=3.0, blocks=6, seq=3),
        rotary("q", t_last=4.0, blocks=4, seq=1),
    )
    for end in (0, 1):
        values = {name: bounds[end] for name, bounds in KNOB_RANGES.items()}
        knobs = knobs_from_mapping({"policy": "lvf", "adaptive_residency": "false", **values})
        b_xfer = knobs.b_xfer or 0
        plan = make_plan(snap(*views, free=3, xfer=b_xfer), knobs)
        message = RotationPlan(
            "w0", "e0", 1, 1, "lvf", [], [], [], [], plan.fcfs_fallback, 1.0, b_xfer
        )
        assert decode(encode(message), RotationPlan).b_xfer_blocks == b_xfer


async def test_a_stored_value_out_of_range_is_repaired_by_replacing_it(
    redis_client: Redis,
) -> None:
    await write_knobs(redis_client, {"policy": "lvf"})
    await redis_client.hset(KNOBS_KEY, "b_xfer", str(10**23))  # written before the ranges
    with pytest.raises(ValueError, match="b_xfer"):
        await read_knobs(redis_client)
    with pytest.raises(ValueError, match="b_xfer"):
        await write_knobs(redis_client, {"alpha": 2.0})  # names what is still wrong
    knobs, _ = await write_knobs(redis_client, {"b_xfer": 64})
    assert knobs.b_xfer == 64 and (await read_knobs(redis_client))[0] == knobs


def test_optional_knobs_round_trip_their_none() -> None:
    """``demote_late_s`` off is stored as "off" (``b_xfer`` auto as "auto") and read back."""
    knobs = knobs_from_mapping({"demote_late_s": "off", "b_xfer": "auto", "deadline_lag": "0"})
    assert knobs.demote_late_s is None and knobs.b_xfer is None and knobs.deadline_lag is False
    stored = knobs_to_mapping(knobs)
    assert stored["demote_late_s"] == "off" and stored["b_xfer"] == "auto"
    assert knobs_from_mapping(stored) == knobs
    on = knobs_from_mapping({"demote_late_s": "2.5"})
    assert on.demote_late_s == 2.5 and knobs_from_mapping(knobs_to_mapping(on)) == on
