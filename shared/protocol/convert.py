"""Policy columns <-> wire tables, both directions in one place (the worker encodes, the
control plane decodes; a field added to one side must be added here), and the stream reader
every service shares."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import structlog

from shared.policy.columns import (
    STATE_CODES,
    STATES_BY_CODE,
    HandleIds,
    RequestColumns,
)
from shared.policy.types import RequestState
from shared.protocol.codec import ProtocolError, decode
from shared.protocol.limits import DEFAULT_LIMITS, Limits
from shared.protocol.table import TABLE_COLUMNS, RequestRow, RequestTable

log = structlog.get_logger(__name__)
T = TypeVar("T")
_INT_WIDTHS = ("<i1", "<i2", "<i4", "<i8")


def table_from_columns(
    columns: RequestColumns, num_blocks_synced: npt.ArrayLike | None = None
) -> RequestTable:
    """Pack ``columns`` (plus each request's DRAM blocks already synced, 0 when not given)
    for the wire, each column as compact as ``TABLE_COLUMNS`` allows. The request ids stay
    here: the table names requests by ``arrival_seq``."""
    return table_from_arrays(arrays_from_columns(columns, num_blocks_synced))


def arrays_from_columns(
    columns: RequestColumns, num_blocks_synced: npt.ArrayLike | None = None
) -> dict[str, np.ndarray]:
    """The table's columns, unpacked (no copy): ``columns`` and the synced blocks."""
    num = len(columns)
    synced = np.zeros(num, np.int64) if num_blocks_synced is None else num_blocks_synced
    arrays = {name: getattr(columns, name) for name in TABLE_COLUMNS if name != "num_blocks_synced"}
    arrays["num_blocks_synced"] = np.asarray(synced, np.int64)
    return arrays


def _pack(name: str, kind: str, values: np.ndarray) -> bytes:
    if kind == "int":
        return _pack_ints(values)
    if kind == "flag":
        return b"" if values.all() else values.astype(np.uint8).tobytes()
    if kind == "code":
        return values.astype(np.uint8).tobytes()
    if kind == "opt" and np.isnan(values).all():
        return b""
    return np.ascontiguousarray(values, "<f8").tobytes()


def _pack_ints(values: np.ndarray) -> bytes:
    """The narrowest little-endian signed width that holds every value; nothing when all
    are zero."""
    if not len(values):
        return b""
    low, high = int(values.min()), int(values.max())
    if low == high == 0:
        return b""
    for dtype in _INT_WIDTHS:
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return values.astype(dtype).tobytes()
    raise ValueError(f"integers out of the 64-bit range: {low}..{high}")


def columns_from_table(table: RequestTable) -> RequestColumns:
    """The policy's columns, straight from the packed arrays (validated on decode): no
    per-request Python object. Each request's id is its handle (:class:`HandleIds`)."""
    return columns_from_arrays(arrays_from_table(table))


def columns_from_arrays(arrays: Mapping[str, np.ndarray]) -> RequestColumns:
    """The policy's columns from a table's unpacked arrays (:func:`arrays_from_table`)."""
    fields = {name: arrays[name] for name in TABLE_COLUMNS if name != "num_blocks_synced"}
    return RequestColumns(request_ids=HandleIds(fields["arrival_seq"]), **fields)


def arrays_from_table(table: RequestTable) -> dict[str, np.ndarray]:
    """Every column of ``table`` unpacked (:meth:`RequestTable.column`), by name."""
    return {name: table.column(name) for name in TABLE_COLUMNS}


def table_from_arrays(arrays: Mapping[str, np.ndarray]) -> RequestTable:
    """Unpacked columns (every ``TABLE_COLUMNS`` name) packed as compactly as the full table
    would be: :func:`arrays_from_table`'s inverse."""
    return RequestTable(
        **{name: _pack(name, kind, arrays[name]) for name, kind in TABLE_COLUMNS.items()}
    )


def table_from_rows(rows: Sequence[RequestRow]) -> RequestTable:
    """Rows (plain values) as a wire table. Raises ValueError for an unknown state."""
    columns: dict[str, np.ndarray] = {}
    for name, kind in TABLE_COLUMNS.items():
        if name == "states":
            values: list[Any] = [STATE_CODES[RequestState(row.state)] for row in rows]
        else:
            values = [getattr(row, name) for row in rows]
        if kind in ("time", "opt"):
            columns[name] = np.array([math.nan if v is None else v for v in values], np.float64)
        else:
            columns[name] = np.array(values, np.bool_ if kind == "flag" else np.int64)
    return RequestTable(
        **{name: _pack(name, TABLE_COLUMNS[name], values) for name, values in columns.items()},
    )


def rows_from_table(table: RequestTable) -> list[RequestRow]:
    """One :class:`RequestRow` per request (NaN -> None)."""
    names = list(TABLE_COLUMNS)
    lists = {name: table.column(name).tolist() for name in names}
    for name in names:
        if TABLE_COLUMNS[name] == "opt":
            lists[name] = [None if math.isnan(v) else v for v in lists[name]]
    rows = []
    for i in range(table.num_requests):
        fields = {name: lists[name][i] for name in names if name != "states"}
        state = STATES_BY_CODE[lists["states"][i]].value
        rows.append(RequestRow(state=state, **fields))
    return rows


def stream_messages(
    response: Any, expected: type[T], event: str, limits: Limits = DEFAULT_LIMITS
) -> Iterator[tuple[Any, T | None]]:
    """(entry id, message) for each entry of an XREAD/XREADGROUP response, decoded within
    ``limits``; a malformed entry is logged under ``event`` and yields None (the caller counts
    or acknowledges it)."""
    for _, entries in response or []:
        for entry_id, fields in entries:
            try:
                yield entry_id, decode(fields.get(b"m", b""), expected, limits)
            except ProtocolError as exc:
                log.error(event, entry_id=entry_id, error=str(exc))
                yield entry_id, None
