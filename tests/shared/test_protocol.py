"""Wire protocol: round trips, and malformed bytes never escape as anything but ProtocolError."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.protocol import (
    AbortRequest,
    ProtocolError,
    RequestRow,
    RotationPlan,
    StateSnapshot,
    SubmitRequest,
    TokenOutput,
    decode,
    encode,
)

SAMPLES = [
    SubmitRequest(
        "r1", [1, 2, 3], "out", 1.5, 16, 0.7, 0.9, 40, 7, [2], True, 1, "interactive", 1.0, 0.05
    ),
    AbortRequest("r1"),
    RotationPlan("w0", "e1", 12, 3, "lvf", ["a"], ["b"], ["c"], [], False, 2.0, 64),
    StateSnapshot(
        "w0",
        "e1",
        12,
        3.0,
        [RequestRow("a", "running", 1.0, 2.0, None, 10, 9, 3, 1, 1, 0, None, 0.1, True, 4)],
        10,
        20,
        30,
        40,
        16,
        2 << 20,
        2048,
        256,
        64,
        0.05,
        5e10,
        "remote",
    ),
    TokenOutput("r1", 3, [5, 6], "stop", None, 4),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg) -> None:
    assert decode(encode(msg), type(msg)) == msg


def test_wrong_version_type_and_fields_are_rejected() -> None:
    raw = msgpack.unpackb(encode(SAMPLES[1]))
    for bad in (
        {**raw, "v": 2},
        {**raw, "t": "nope"},
        {**raw, "d": []},
        {**raw, "d": [5]},
        {"v": 1},
        [1, 2],
    ):
        with pytest.raises(ProtocolError):
            decode(msgpack.packb(bad))
    with pytest.raises(ProtocolError, match="expected"):
        decode(encode(SAMPLES[1]), TokenOutput)
    submit = msgpack.unpackb(encode(SAMPLES[0]))
    submit["d"][1] = []  # empty prompt fails the message's own validation
    with pytest.raises(ProtocolError, match="prompt"):
        decode(msgpack.packb(submit))


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode(data)


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.binary(max_size=5),
)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4), max_leaves=12)


@settings(max_examples=1500, deadline=None)
@given(
    tag=st.sampled_from(["submit", "abort", "plan", "snapshot", "tokens", "knobs", "x"]),
    fields=st.lists(_values, max_size=17),
)
def test_well_framed_garbage_raises_only_protocol_error(tag: str, fields: list) -> None:
    with contextlib.suppress(ProtocolError):
        decode(msgpack.packb({"v": 1, "t": tag, "d": fields}))
