"""Snapshots as deltas: a worker sends only the request rows that changed since a snapshot the
control plane already holds, and the control plane rebuilds the whole table.

The base is the snapshot the worker's newest fresh plan was computed from: the replica that
planned it decoded it, so it holds that table. Rows are matched by handle (``arrival_seq``):
in a decoding engine only the running requests' counts move each iteration, so at 4,096
requests of which a few hundred run, a delta is a tenth of the table. Both sides keep their
last few full tables by iteration (:class:`DeltaEncoder` on the worker, :class:`DeltaDecoder`
per worker on the control plane). A delta whose base the receiver lacks (a new owner after a
lease handover, a restarted replica) raises :class:`MissingBase`: that snapshot is not planned,
the worker's plans age out and it sends whole tables until a plan comes again. Pure mechanism:
no I/O, no policy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import NamedTuple, cast

import numpy as np

from shared.policy.columns import RequestColumns
from shared.protocol.codec import ProtocolError
from shared.protocol.convert import columns_from_arrays, columns_from_table, table_from_arrays
from shared.protocol.messages import StateSnapshot
from shared.protocol.table import TABLE_COLUMNS, RequestTable, TableDelta

# A table row as one fixed-width record of 13 little-endian words (two code bytes, then the
# floats, then the integers; padding zeroed): rows are compared and gathered as uint64 rows.
_FLOATS = [name for name, kind in TABLE_COLUMNS.items() if kind in ("time", "opt")]
_INTS = [name for name, kind in TABLE_COLUMNS.items() if kind == "int"]
ROW_DTYPE = np.dtype(
    {
        "names": ["states", "resident", *_FLOATS, *_INTS],
        "formats": ["u1", "u1"] + ["<f8"] * len(_FLOATS) + ["<i8"] * len(_INTS),
        "offsets": [0, 1] + [8 * (1 + i) for i in range(len(_FLOATS) + len(_INTS))],
        "itemsize": 8 * (1 + len(_FLOATS) + len(_INTS)),
    }
)
ROW_WORDS = ROW_DTYPE.itemsize // 8
DENSE_RANGE = 8  # handles spanning up to this many times the rows are looked up directly
_SEQ = "arrival_seq"


class MissingBase(ProtocolError):
    """A delta against a snapshot this receiver does not hold."""


class EncodedRequests(NamedTuple):
    """What a snapshot's ``requests`` and ``delta`` fields carry."""

    requests: RequestTable
    delta: TableDelta | None


def records_from_table(table: RequestTable) -> np.ndarray:
    """``table`` as an (n, ROW_WORDS) uint64 array, one row per request."""
    return records_from_arrays({name: table.column(name) for name in TABLE_COLUMNS})


def records_from_arrays(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """Unpacked columns (every ``TABLE_COLUMNS`` name) as records, one row per request."""
    codes = arrays["states"].astype(np.uint64) | (arrays["resident"].astype(np.uint64) << 8)
    words = [codes]
    words += [np.ascontiguousarray(arrays[name], np.float64).view(np.uint64) for name in _FLOATS]
    words += [np.asarray(arrays[name], np.int64).view(np.uint64) for name in _INTS]
    return np.stack(words, axis=1)


def _fields(rows: np.ndarray) -> np.ndarray:
    return rows.reshape(-1).view(ROW_DTYPE)


def arrays_from_records(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Records as one contiguous array per column (:func:`records_from_arrays`' inverse)."""
    words = np.ascontiguousarray(rows.T)
    arrays = {
        "states": (words[0] & 0xFF).astype(np.uint8),
        "resident": ((words[0] >> 8) & 1).astype(np.bool_),
    }
    for i, name in enumerate(_FLOATS, start=1):
        arrays[name] = words[i].view(np.float64)
    for i, name in enumerate(_INTS, start=1 + len(_FLOATS)):
        arrays[name] = words[i].view(np.int64)
    return arrays


def table_from_records(rows: np.ndarray) -> RequestTable:
    return table_from_arrays(arrays_from_records(rows))


def columns_from_records(rows: np.ndarray) -> RequestColumns:
    """The policy's columns: strided views into ``rows`` (no copy)."""
    fields = _fields(rows)
    arrays = {name: fields[name] for name in TABLE_COLUMNS}
    arrays["resident"] = arrays["resident"].view(np.bool_)
    return columns_from_arrays(arrays)


class _Kept:
    """A kept table: as it arrived (a whole table) or rebuilt (records); its records and
    handle index are made when it first serves as a base."""

    __slots__ = ("_arrays", "_index", "_rows", "_table")

    def __init__(
        self,
        table: RequestTable | None = None,
        rows: np.ndarray | None = None,
        arrays: dict[str, np.ndarray] | None = None,
    ) -> None:
        self._table, self._rows, self._arrays = table, rows, arrays
        self._index: _HandleIndex | None = None

    @property
    def rows(self) -> np.ndarray:
        if self._rows is None:
            if self._arrays is not None:
                self._rows = records_from_arrays(self._arrays)
            else:
                self._rows = records_from_table(cast(RequestTable, self._table))
            self._arrays = self._table = None
        return self._rows

    def find(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row of each of ``seqs`` here, whether it is here at all)."""
        if self._index is None:
            self._index = _HandleIndex(_fields(self.rows)[_SEQ])
        return self._index.find(seqs)


class _HandleIndex:
    """Row by handle: a direct table over the handles' range when it is at most DENSE_RANGE
    times the rows (handles are arrival numbers: usually dense), else binary search."""

    __slots__ = ("_direct", "_low", "_order", "_sorted")

    def __init__(self, seqs: np.ndarray) -> None:
        self._low = int(seqs.min()) if len(seqs) else 0
        span = int(seqs.max()) - self._low + 1 if len(seqs) else 0
        self._direct: np.ndarray | None = None
        self._order = self._sorted = np.zeros(0, np.int64)
        if span <= DENSE_RANGE * len(seqs):
            self._direct = np.full(span + 1, -1, np.int64)  # one past the end stays -1
            self._direct[seqs - self._low] = np.arange(len(seqs))
        else:
            self._order = np.argsort(seqs, kind="stable")
            self._sorted = seqs[self._order]

    def find(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._direct is not None:
            offsets = np.clip(seqs - self._low, 0, len(self._direct) - 1)
            at = self._direct[offsets]
            return np.maximum(at, 0), (at >= 0) & (seqs >= self._low)
        pos = np.minimum(np.searchsorted(self._sorted, seqs), len(self._sorted) - 1)
        return self._order[pos], self._sorted[pos] == seqs


class _History:
    """The last ``max_num_kept`` tables by iteration."""

    def __init__(self, max_num_kept: int) -> None:
        if max_num_kept < 1:
            raise ValueError("max_num_kept must be >= 1")
        self.max_num_kept = max_num_kept
        self.kept: OrderedDict[int, _Kept] = OrderedDict()

    def keep(self, iteration: int, kept: _Kept) -> None:
        self.kept[iteration] = kept
        self.kept.move_to_end(iteration)
        while len(self.kept) > self.max_num_kept:
            self.kept.popitem(last=False)


def base_rows(rows: np.ndarray, base: _Kept) -> np.ndarray:
    """For each of ``rows``: the row of ``base`` it repeats exactly (same handle, every
    column equal), or -1."""
    at, found = base.find(_fields(rows)[_SEQ])
    if not len(base.rows):
        return np.full(len(rows), -1, np.int64)
    same = found & (rows == base.rows.take(at, axis=0)).all(axis=1)
    return np.where(same, at, -1)


def _pack_signed(values: np.ndarray) -> bytes:
    low, high = int(values.min(initial=0)), int(values.max(initial=0))
    for dtype in ("<i1", "<i2", "<i4", "<i8"):
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return values.astype(dtype).tobytes()
    raise ValueError(f"row {high} is out of the 64-bit range")


class DeltaEncoder:
    """The worker's side: its last ``max_num_kept`` published tables, by iteration; each new
    table goes out as a delta against the base it is told, when that base is kept here and at
    most ``max_changed_frac`` of the rows changed (the delta is then at most about that
    fraction of the table's bytes, plus 1-4 bytes a request; a larger one would cost both
    sides more CPU than its bytes save). After a delta that did not pay, the next
    ``retry_after`` snapshots go whole without trying."""

    def __init__(
        self, max_num_kept: int = 8, max_changed_frac: float = 0.5, retry_after: int = 8
    ) -> None:
        self._history = _History(max_num_kept)
        self.max_changed_frac = max_changed_frac
        self.retry_after = retry_after
        self._next_try = 0  # the first iteration that may try a delta again
        self.num_full = 0
        self.num_deltas = 0

    def encode(
        self, iteration: int, arrays: Mapping[str, np.ndarray], base_iteration: int | None
    ) -> EncodedRequests:
        """Iteration ``iteration``'s whole table, given unpacked (every ``TABLE_COLUMNS``
        name: ``shared.protocol.convert.arrays_from_columns``), as it should travel."""
        base = None
        if base_iteration is not None and base_iteration < iteration:
            base = self._history.kept.get(base_iteration) if self._next_try <= iteration else None
        if base is not None and base_iteration is not None:
            rows = records_from_arrays(arrays)
            self._history.keep(iteration, _Kept(rows=rows))
            delta = self._delta(rows, base, base_iteration)
            if delta is not None:
                self.num_deltas += 1
                return delta
            self._next_try = iteration + self.retry_after
        else:  # kept as copies (callers reuse their arrays); records only if it becomes a base
            copies = {name: np.array(values) for name, values in arrays.items()}
            self._history.keep(iteration, _Kept(arrays=copies))
        self.num_full += 1
        return EncodedRequests(table_from_arrays(arrays), None)

    def _delta(self, rows: np.ndarray, base: _Kept, base_iteration: int) -> EncodedRequests | None:
        at = base_rows(rows, base)
        changed = np.flatnonzero(at < 0)
        if len(changed) > self.max_changed_frac * len(rows):
            return None
        table = table_from_records(rows.take(changed, axis=0))
        return EncodedRequests(table, TableDelta(base_iteration, len(rows), _pack_signed(at)))


def apply_delta(base: _Kept, changed: RequestTable, delta: TableDelta) -> np.ndarray:
    """The whole table's records: each request takes its base row, or the next changed row.
    Raises ProtocolError when the counts do not match or a base row does not exist."""
    source = delta.rows()
    new = source < 0
    if int(new.sum()) != changed.num_requests:
        raise ProtocolError("a delta's changed rows and its base rows do not match")
    base_records = base.rows
    if len(source) and int(source.max()) >= len(base_records):
        raise ProtocolError("a delta names a row its base does not have")
    if len(source) and not len(base_records):  # every row is new: nothing to take
        return records_from_table(changed)
    rows = base_records.take(np.maximum(source, 0), axis=0)
    rows[new] = records_from_table(changed)
    return rows


class DeltaDecoder:
    """The control plane's side, for one worker: the whole tables of its last
    ``max_num_kept`` snapshots decoded in the current epoch."""

    def __init__(self, max_num_kept: int = 4) -> None:
        self._history = _History(max_num_kept)
        self.epoch = ""

    def columns(self, msg: StateSnapshot) -> RequestColumns:
        """``msg``'s whole table as policy columns (rebuilt from its base when it is a
        delta), kept as a base for later deltas. Raises MissingBase or ProtocolError."""
        if msg.epoch != self.epoch:
            self.epoch = msg.epoch
            self._history.kept.clear()
        if msg.delta is None:
            self._history.keep(msg.iteration, _Kept(table=msg.requests))
            return columns_from_table(msg.requests)
        base = self._history.kept.get(msg.delta.base_iteration)
        if base is None:
            raise MissingBase(f"no base iteration {msg.delta.base_iteration} here")
        rows = apply_delta(base, msg.requests, msg.delta)
        self._history.keep(msg.iteration, _Kept(rows=rows))
        return columns_from_records(rows)
