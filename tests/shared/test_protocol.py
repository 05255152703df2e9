"""Wire protocol: round trips, and malformed bytes never escape as anything but ProtocolError."""

from __future__ import annotations

import contextlib
import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy import ColumnarSnapshot, Knobs
from shared.policy.lvf import lvf
from shared.protocol import (
    SCHEMA_VERSION,
    AbortRequest,
    ProtocolError,
    RequestRow,
    RotationPlan,
    StateSnapshot,
    SubmitRequest,
    TokenOutput,
    TokenOutputs,
    WorkerStatus,
    decode,
    encode,
)
from shared.protocol.convert import columns_from_table, rows_from_table, table_from_rows
from shared.protocol.table import TABLE_COLUMNS, RequestTable
from shared.sampling import SamplingParams

ROWS = [
    RequestRow("running", 1.0, 2.0, None, 10, 9, 3, 1, 1, 0, None, 0.1, True, 4),
    RequestRow("waiting", 1.5, None, None, 7, 0, 0, 0, 0, -2, 3.0, None, True, 5),
    RequestRow("rotary", 0.5, 1.0, 2.5, 40, 39, 0, 3, 3, 1, None, None, False, 2**40),
]

STATUS = WorkerStatus(
    "w0", "e1", 5.0, "m", 4096, 3, 2, 0, 900, 100, 40, 0, 0, 2048, 0.05, "local", "vllm",
    0, 0, 0, 0, 0, True, prefill_tokens_per_s=712.5, decode_step_s=0.012,
)  # fmt: skip

SAMPLES = [
    SubmitRequest(
        "r1",
        [1, 2, 3],
        "out",
        1.5,
        SamplingParams(16, 0.7, 0.9, 40, 7, (), (2,), True),
        1,
        "interactive",
        1.0,
        0.05,
    ),
    AbortRequest("r1"),
    RotationPlan("w0", "e1", 12, 3, "lvf", [5], [2**40], [4], [], False, 2.0, 64),
    StateSnapshot(
        "w0",
        "e1",
        12,
        3.0,
        table_from_rows(ROWS),
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
    TokenOutput(
        "r2", 0, [], "error", "prompt too long", error_kind="rejected", error_param="prompt"
    ),
    STATUS,
    TokenOutputs([TokenOutput("r1", 3, [5, 6], None), TokenOutput("r3", 0, [7], "length")]),
]


def test_a_bad_output_in_a_batch_rejects_the_batch() -> None:
    wire = msgpack.unpackb(encode(SAMPLES[-1]), raw=False)
    wire["d"][0][1][2] = ["x"]  # token ids must be integers
    with pytest.raises(ProtocolError, match="token_ids"):
        decode(msgpack.packb(wire, use_bin_type=True), TokenOutputs)


def test_token_errors_carry_a_known_kind() -> None:
    good = TokenOutput("r", 0, [], "error", "boom", error_kind="engine")
    wire = msgpack.unpackb(encode(good), raw=False)
    for kind in ("oops", None):  # an unknown kind, or an error without its kind
        wire["d"][-5] = kind  # error_kind, then logprobs, prompt_logprobs, error_param, cached
        with pytest.raises(ProtocolError, match="error_kind"):
            decode(msgpack.packb(wire, use_bin_type=True), TokenOutput)
    with pytest.raises(ValueError, match="come together"):
        TokenOutput("r", 0, [], None, None, error_kind="engine")


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg) -> None:
    assert decode(encode(msg), type(msg)) == msg


def test_wrong_version_type_and_fields_are_rejected() -> None:
    raw = msgpack.unpackb(encode(SAMPLES[1]))
    for bad in (
        {**raw, "v": SCHEMA_VERSION - 1},  # the per-row snapshot format
        {**raw, "v": SCHEMA_VERSION + 1},
        {**raw, "t": "nope"},
        {**raw, "d": []},
        {**raw, "d": [5]},
        {"v": SCHEMA_VERSION},
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
    tag=st.sampled_from(["submit", "abort", "plan", "snapshot", "tokens", "token_batch", "x"]),
    fields=st.lists(_values, max_size=17),
)
def test_well_framed_garbage_raises_only_protocol_error(tag: str, fields: list) -> None:
    with contextlib.suppress(ProtocolError):
        decode(msgpack.packb({"v": SCHEMA_VERSION, "t": tag, "d": fields}))


# ---- the columnar snapshot (schema 2) --------------------------------------------------------


def _snapshot_fields() -> list:
    return msgpack.unpackb(encode(SAMPLES[3]))["d"]


def _table_field(name: str) -> int:
    return [f.name for f in dataclasses.fields(RequestTable)].index(name)


def test_snapshot_rows_round_trip_through_the_packed_table() -> None:
    msg = decode(encode(SAMPLES[3]), StateSnapshot)
    assert rows_from_table(msg.requests) == ROWS
    assert table_from_rows([]) == decode(encode(table_snapshot([])), StateSnapshot).requests


def table_snapshot(rows: list[RequestRow]) -> StateSnapshot:
    return dataclasses.replace(SAMPLES[3], requests=table_from_rows(rows))


def test_columns_take_the_narrowest_width_and_defaults_take_none() -> None:
    table = SAMPLES[3].requests
    assert len(table.num_tokens) == 3  # 10, 7, 40: one byte each
    assert len(table.arrival_seq) == 3 * 8  # 2**40 needs 8
    assert len(table.priority) == 3  # -2..1
    assert table.slo_ttft_s and table.slo_tbt_s  # some request has one
    uniform = table_from_rows([dataclasses.replace(r, resident=True, priority=0) for r in ROWS])
    assert uniform.resident == b"" and uniform.priority == b""
    assert rows_from_table(uniform)[2].resident is True
    no_slo = table_from_rows([dataclasses.replace(r, slo_ttft_s=None) for r in ROWS])
    assert no_slo.slo_ttft_s == b"" and rows_from_table(no_slo)[0].slo_ttft_s is None


@pytest.mark.parametrize(
    ("column", "value", "error"),
    [
        ("states", b"\x01\x00", "bytes for 2 requests"),  # one row short: the others are long
        ("states", b"\x01\x00\x03", "state code"),
        ("resident", b"\x01\x00\x02", "resident"),
        ("t_arr_s", np.array([1.0, np.nan, 2.0]).tobytes(), "t_arr_s"),
        ("t_last_s", np.array([1.0, np.inf, np.nan]).tobytes(), "t_last_s"),
        ("num_tokens", np.array([1, -1, 2], "<i4").tobytes(), "num_tokens"),
        ("arrival_seq", bytes(9), "arrival_seq"),  # 3-byte integers do not exist
        ("t_arr_s", b"", "t_arr_s"),  # arrival times cannot be left out
        ("states", b"", "for 0 requests"),
        ("arrival_seq", np.array([1, -1, 2], "<i2").tobytes(), "arrival_seq"),  # a handle
        ("slo_tbt_s", [1.0, 2.0, 3.0], "binary"),
    ],
)
def test_malformed_snapshot_tables_are_rejected(column: str, value: object, error: str) -> None:
    fields = _snapshot_fields()
    fields[4][_table_field(column)] = value
    with pytest.raises(ProtocolError, match=error):
        decode(msgpack.packb({"v": SCHEMA_VERSION, "t": "snapshot", "d": fields}))


@pytest.mark.parametrize(
    ("index", "value"),
    [(3, float("nan")), (9, 0), (14, float("inf")), (15, -1.0), (6, 2**63), (12, -1), (2, -5)],
)
def test_malformed_snapshot_scalars_are_rejected(index: int, value: object) -> None:
    fields = _snapshot_fields()
    fields[index] = value  # t_now_s, block_size, iteration_time_s, link_bytes_per_s, counts
    with pytest.raises(ProtocolError):
        decode(msgpack.packb({"v": SCHEMA_VERSION, "t": "snapshot", "d": fields}))


@settings(max_examples=600, deadline=None)
@given(
    column=st.integers(0, len(TABLE_COLUMNS) - 1),
    value=st.one_of(st.binary(max_size=64), _values),
)
def test_garbage_in_a_snapshot_table_raises_only_protocol_error(column: int, value) -> None:
    fields = _snapshot_fields()
    fields[4][column] = value
    with contextlib.suppress(ProtocolError):
        msg = decode(msgpack.packb({"v": SCHEMA_VERSION, "t": "snapshot", "d": fields}))
        snapshot = ColumnarSnapshot(  # what the control plane does with it next
            msg.t_now_s,
            columns_from_table(msg.requests),
            msg.num_free_hbm_blocks,
            msg.num_free_dram_blocks,
            msg.block_size,
            msg.max_num_batched_tokens,
            msg.max_num_seqs,
            msg.b_xfer_blocks,
        )
        lvf(snapshot, Knobs(policy="lvf"))


@pytest.mark.parametrize(
    "change",
    [
        {"t_arr_s": float("nan")},
        {"t_arr_s": float("inf")},
        {"slo_ttft_s": float("nan")},
        {"slo_tbt_s": 0.0},
        {"slo_tbt_s": -1.0},
    ],
)
def test_a_request_whose_times_could_not_be_planned_is_refused(change: dict) -> None:
    """A non-finite arrival or SLO would make every snapshot of its worker fail to encode
    (its worker would plan alone for that request's lifetime): refused where it is read."""
    good = SubmitRequest("r", [1, 2], "reply", 1.0, SamplingParams(4), slo_ttft_s=1.0)
    with pytest.raises(ValueError, match=next(iter(change))):
        dataclasses.replace(good, **change)
    wire = msgpack.unpackb(encode(good))
    names = [f.name for f in dataclasses.fields(SubmitRequest)]
    for name, value in change.items():
        wire["d"][names.index(name)] = value
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(wire), SubmitRequest)
