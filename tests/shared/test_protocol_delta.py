"""Snapshots as deltas (shared/protocol/delta.py): what the control plane rebuilds equals the
whole table the worker had, bit for bit, under random changes, arrivals, departures and
reorders; a delta pays where most rows stand still; bad deltas are refused, not rebuilt."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.service import plan_for
from lab.standin import Population, StandIn
from shared.policy import Knobs
from shared.protocol import ProtocolError, StateSnapshot, TableDelta, decode, encode
from shared.protocol.convert import (
    arrays_from_columns,
    columns_from_table,
    rows_from_table,
    table_from_arrays,
    table_from_columns,
)
from shared.protocol.delta import (
    DeltaDecoder,
    DeltaEncoder,
    MissingBase,
    _Kept,
    apply_delta,
    records_from_table,
)
from shared.protocol.table import TABLE_COLUMNS, RequestTable

FIELDS = [name for name in TABLE_COLUMNS if name != "num_blocks_synced"]


def _snapshot(iteration: int, requests: RequestTable, delta: TableDelta | None, epoch="e1"):
    return StateSnapshot(
        "w0", epoch, iteration, 1.0, requests, 10, 10, 100, 100, 16, 1024, 256, 256, 64, 0.05,
        0.0, "remote", delta=delta,
    )  # fmt: skip


def _over_the_wire(msg: StateSnapshot) -> StateSnapshot:
    return decode(encode(msg), StateSnapshot)


def _assert_same_table(columns, whole: RequestTable) -> None:
    expected = columns_from_table(whole)
    for name in FIELDS:
        got, want = getattr(columns, name), getattr(expected, name)
        assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True), name
    assert list(columns.request_ids) == list(expected.request_ids)


def _random_table(rng: np.random.Generator, seqs: np.ndarray) -> dict[str, np.ndarray]:
    num = len(seqs)
    maybe_nan = np.where(rng.random(num) < 0.3, np.nan, rng.uniform(0, 100, num))
    return {
        "states": rng.integers(0, 3, num).astype(np.uint8),
        "t_arr_s": rng.uniform(0, 100, num),
        "t_run_s": maybe_nan,
        "t_last_s": np.where(rng.random(num) < 0.5, np.nan, rng.uniform(0, 100, num)),
        "slo_ttft_s": np.full(num, np.nan) if rng.random() < 0.5 else rng.uniform(0.1, 5, num),
        "slo_tbt_s": np.full(num, np.nan),
        "num_tokens": rng.integers(1, 70_000, num),
        "num_computed_tokens": rng.integers(0, 300, num),
        "num_blocks_hbm": rng.integers(0, 40, num),
        "num_blocks_dram": np.zeros(num, np.int64),
        "num_blocks_synced": rng.integers(0, 3, num),
        "priority": rng.integers(-2, 3, num),
        "arrival_seq": seqs.astype(np.int64),
        "resident": rng.random(num) < 0.9,
        "tenants": rng.integers(0, 5, num),
        "t_first_s": np.where(rng.random(num) < 0.5, np.nan, rng.uniform(0, 100, num)),
        "num_output_tokens": rng.integers(0, 300, num),
    }


def _step(rng: np.random.Generator, arrays: dict[str, np.ndarray], next_seq: int):
    """Some rows change a column, some leave, some arrive; sometimes the order changes."""
    num = len(arrays["arrival_seq"])
    keep = rng.random(num) >= rng.choice([0.0, 0.1, 0.5])
    out = {name: values[keep].copy() for name, values in arrays.items()}
    changed = np.flatnonzero(rng.random(len(out["states"])) < rng.choice([0.0, 0.05, 0.6]))
    out["num_tokens"][changed] += 1
    out["num_output_tokens"][changed] += 1
    out["t_run_s"][changed[::2]] = np.nan
    out["resident"][changed[1::3]] ^= True
    num_new = int(rng.integers(0, 6))
    fresh = _random_table(rng, np.arange(next_seq, next_seq + num_new))
    out = {name: np.concatenate([out[name], fresh[name]]) for name in out}
    if rng.random() < 0.3:
        order = rng.permutation(len(out["states"]))
        out = {name: values[order] for name, values in out.items()}
    return out, next_seq + num_new


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num=st.integers(0, 80), steps=st.integers(1, 12))
def test_the_rebuilt_table_is_the_whole_table(seed: int, num: int, steps: int) -> None:
    rng = np.random.default_rng(seed)
    encoder, decoder = DeltaEncoder(max_changed_frac=1.0), DeltaDecoder()
    spread = 1 if rng.random() < 0.5 else 1000  # dense handles, or sparse (binary search)
    seqs = rng.permutation(num * 3)[:num] * spread
    arrays, next_seq = _random_table(rng, seqs), num * 3 * spread
    records: dict[int, np.ndarray] = {}
    for iteration in range(steps):
        if iteration:
            arrays, next_seq = _step(rng, arrays, next_seq)
        base = None if iteration == 0 else iteration - int(rng.integers(1, min(iteration, 4) + 1))
        sent = encoder.encode(iteration, arrays, base)
        whole = table_from_arrays(arrays)
        msg = _over_the_wire(_snapshot(iteration, sent.requests, sent.delta))
        _assert_same_table(decoder.columns(msg), whole)
        records[iteration] = records_from_table(whole)
        if msg.delta is not None:  # every column, the DRAM-synced counts too
            rebuilt = apply_delta(_Kept(rows=records[base]), msg.requests, msg.delta)
            assert np.array_equal(rebuilt, records[iteration])
    assert encoder.num_deltas + encoder.num_full == steps


def _overloaded(num: int = 4096, running: int = 256):
    pop = Population.synthetic(num, seed=3, max_num_seqs=running)
    return pop, {k: v.copy() for k, v in arrays_from_columns(pop.columns()).items()}


def test_a_delta_pays_where_most_rows_stand_still_and_plans_the_same() -> None:
    """An engine with 4,096 requests of which 256 run: each iteration moves only the running
    rows, so the delta is about a tenth of the whole table; LVF plans the same from both."""
    pop = Population.synthetic(4096, seed=3, max_num_seqs=256)
    pop.max_num_seqs = 320  # room to admit: the plan has moves to compare
    worker, decoder = StandIn("w0", pop), DeltaDecoder()
    now = time.time()
    decoder.columns(_over_the_wire(worker.snapshot(0, now, 0.05)))
    pop.advance(now)
    sent = worker.snapshot(1, now + 0.05, 0.05, base=0)
    assert sent.delta is not None and sent.requests.num_requests <= 256
    whole = replace(sent, requests=table_from_columns(pop.columns()), delta=None)
    delta_bytes, whole_bytes = len(encode(sent)), len(encode(whole))
    assert delta_bytes < 0.15 * whole_bytes, (delta_bytes, whole_bytes)
    msg = _over_the_wire(sent)
    columns = decoder.columns(msg)
    _assert_same_table(columns, whole.requests)
    knobs = Knobs(policy="lvf")
    from_delta = plan_for(msg, knobs, 1, columns=columns)
    from_whole = plan_for(_over_the_wire(whole), knobs, 1)
    moves = ("admit_seqs", "resume_seqs", "rotate_out_seqs", "preempt_seqs", "b_xfer_blocks")
    assert [getattr(from_delta, m) for m in moves] == [getattr(from_whole, m) for m in moves]
    assert from_whole.admit_seqs or from_whole.rotate_out_seqs or from_whole.resume_seqs


def test_whole_tables_go_when_a_delta_would_not_pay_or_has_no_base() -> None:
    pop = Population.synthetic(256, seed=1)  # half the rows run: half change each iteration
    encoder = DeltaEncoder(max_changed_frac=0.25, retry_after=3)
    tables = []
    for iteration in range(6):
        tables.append(encoder.encode(iteration, arrays_from_columns(pop.columns()), iteration - 1))
        pop.advance(time.time())
    assert [t.delta for t in tables] == [None] * 6  # iteration 0: no base; then > 25% changed
    assert encoder.num_full == 6
    assert encoder.encode(9, arrays_from_columns(pop.columns()), 2).delta is None  # older base
    assert encoder.encode(10, arrays_from_columns(pop.columns()), 42).delta is None  # unknown
    still = DeltaEncoder(max_changed_frac=0.25)
    still.encode(0, arrays_from_columns(pop.columns()), None)
    assert still.encode(1, arrays_from_columns(pop.columns()), 0).delta is not None  # no change


def test_a_delta_without_its_base_is_refused_and_a_new_epoch_forgets_the_bases() -> None:
    _, arrays = _overloaded(64, 8)
    encoder, decoder = DeltaEncoder(), DeltaDecoder(max_num_kept=2)
    decoder.columns(_snapshot(0, encoder.encode(0, arrays, None).requests, None))
    sent = encoder.encode(1, arrays, 0)
    assert sent.delta is not None and sent.requests.num_requests == 0  # nothing changed
    with pytest.raises(MissingBase):
        decoder.columns(_snapshot(1, sent.requests, sent.delta, epoch="e2"))  # a restart
    for iteration in range(2, 5):  # the base ages out of the decoder's window
        decoder.columns(_snapshot(iteration, table_from_arrays(arrays), None))
    with pytest.raises(MissingBase):
        decoder.columns(_snapshot(5, sent.requests, TableDelta(0, 64, sent.delta.base_rows)))


def test_malformed_deltas_are_protocol_errors() -> None:
    _, arrays = _overloaded(16, 4)
    whole = table_from_arrays(arrays)
    for bad in (
        lambda: TableDelta(0, 16, b"\x00" * 15),  # no width fits
        lambda: TableDelta(0, 0, b"\x00"),
        lambda: TableDelta(0, 2, np.array([-2, 0], "<i1").tobytes()),
        lambda: _snapshot(3, whole, TableDelta(3, 16, bytes(16))),  # base not earlier
        lambda: _snapshot(3, whole, TableDelta(1, 2, bytes(2))),  # more rows than requests
    ):
        with pytest.raises(ValueError):
            bad()
    decoder = DeltaDecoder()
    decoder.columns(_snapshot(0, whole, None))
    empty = table_from_arrays({name: values[:0] for name, values in arrays.items()})
    out_of_range = TableDelta(0, 2, np.array([0, 16], "<i1").tobytes())
    missing_row = TableDelta(0, 2, np.array([0, -1], "<i1").tobytes())
    for delta in (out_of_range, missing_row):
        with pytest.raises(ProtocolError):
            decoder.columns(_snapshot(1, empty, delta))
    assert math.isfinite(decoder.columns(_snapshot(2, whole, None)).t_arr_s.sum())
    assert rows_from_table(whole)  # the table itself stays readable
