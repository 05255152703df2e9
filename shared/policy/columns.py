"""Requests as columns: one numpy array per :class:`RequestView` field, no per-request objects.

The control plane builds :class:`ColumnarSnapshot` straight from the wire (the snapshot travels
as packed arrays); :func:`columnar_from_snapshot` converts the engine's in-process
:class:`~shared.policy.types.Snapshot` and :func:`snapshot_from_columnar` goes back (for the
policies that walk views). Optional times and SLOs (``None`` in a view) are NaN here. The
fields, their dtypes and how they pack all follow :data:`~shared.policy.types.REQUEST_FIELDS`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from shared.policy.types import REQUEST_FIELDS, RequestField, RequestState, RequestView, Snapshot

WAITING_CODE, RUNNING_CODE, ROTARY_CODE = 0, 1, 2
STATE_CODES = {RequestState.WAITING: 0, RequestState.RUNNING: 1, RequestState.ROTARY: 2}
STATES_BY_CODE = (RequestState.WAITING, RequestState.RUNNING, RequestState.ROTARY)

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]

FLOAT_FIELDS = tuple(f.column for f in REQUEST_FIELDS if f.pack in ("time", "opt"))
INT_FIELDS = tuple(f.column for f in REQUEST_FIELDS if f.pack == "int")
_ARRAYS = tuple(f for f in REQUEST_FIELDS if f.pack != "id")  # every column but the ids


class HandleIds:
    """The ids of requests known only by their handle (``arrival_seq``), as the control plane
    gets them off the wire: each id is the handle in decimal, made only for the ids a plan
    names (the view-walking policies; the columnar LVF returns row indices)."""

    __slots__ = ("_seqs",)

    def __init__(self, seqs: Ints) -> None:
        self._seqs = seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, index: int) -> str:
        return str(int(self._seqs[index]))

    def __iter__(self) -> Iterator[str]:
        return iter(self.pick(np.arange(len(self))))

    def pick(self, indices: Ints) -> list[str]:
        return list(map(str, self._seqs[indices].tolist()))


RequestIds = list[str] | HandleIds


def pick_ids(ids: RequestIds, indices: Ints) -> list[str]:
    """``[ids[i] for i in indices]``."""
    if isinstance(ids, HandleIds):
        return ids.pick(indices)
    if len(indices) == 0:
        return []
    if len(indices) == 1:
        return [ids[int(indices[0])]]
    return list(itemgetter(*indices.tolist())(ids))


@dataclass(frozen=True, slots=True, eq=False)
class RequestColumns:
    """Every request of one snapshot, in running-list order, one array per field.

    ``states`` holds :data:`STATE_CODES`; the float columns are NaN where the view has None
    (only ``t_arr_s`` is always set). Arrays are treated as read-only.
    """

    request_ids: RequestIds
    states: npt.NDArray[np.uint8]
    t_arr_s: Floats
    t_run_s: Floats
    t_last_s: Floats
    slo_ttft_s: Floats
    slo_tbt_s: Floats
    num_tokens: Ints
    num_computed_tokens: Ints
    num_blocks_hbm: Ints
    num_blocks_dram: Ints
    priority: Ints
    arrival_seq: Ints
    resident: npt.NDArray[np.bool_]
    tenants: Ints
    t_first_s: Floats
    num_output_tokens: Ints

    def __post_init__(self) -> None:
        num = len(self.request_ids)
        for field in _ARRAYS:
            if len(getattr(self, field.column)) != num:
                rows = len(getattr(self, field.column))
                raise ValueError(f"column {field.column} has {rows} rows, not {num}")

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True, slots=True, eq=False)
class ColumnarSnapshot:
    """:class:`~shared.policy.types.Snapshot` with its requests as :class:`RequestColumns`."""

    t_now_s: float
    requests: RequestColumns
    num_free_hbm_blocks: int
    num_free_dram_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    b_xfer_blocks: int = 0
    iteration: int = 0
    tenant_service: tuple[float, ...] = ()  # as Snapshot's
    long_prefill_token_threshold: int = 0  # as Snapshot's


def _check_column_fields() -> None:
    """:class:`RequestColumns` has one field per :data:`REQUEST_FIELDS` column, or this
    raises TypeError."""
    declared = {f.column for f in REQUEST_FIELDS}
    actual = {f.name for f in fields(RequestColumns)}
    if declared != actual:
        raise TypeError(f"RequestColumns' fields {sorted(actual)} are not REQUEST_FIELDS")


_check_column_fields()


def columns_from_views(views: Sequence[RequestView]) -> RequestColumns:
    """The views as columns (None -> NaN): one C-level pass per field, about 0.5 us per
    request in all (the engine's in-process snapshot; the control plane never needs it)."""
    if not views:
        return empty_columns()
    return RequestColumns(**column_arrays_from_views(views))


def column_arrays_from_views(views: Sequence[RequestView]) -> dict[str, Any]:
    """:func:`columns_from_views`' fields, as keyword arguments of :class:`RequestColumns`."""
    num = len(views)
    return {f.column: _column(map(attrgetter(f.name), views), f, num) for f in REQUEST_FIELDS}


def _column(values: Iterator[Any], field: RequestField, num: int) -> Any:
    """One field's values as its column (a list for the ids)."""
    if field.pack == "id":
        return list(values)
    if field.pack == "code":
        return np.fromiter(map(STATE_CODES.__getitem__, values), field.dtype, num)
    if field.pack == "opt":
        nan = math.nan
        return np.fromiter([nan if v is None else v for v in values], field.dtype, num)
    return np.fromiter(values, field.dtype, num)


def empty_columns() -> RequestColumns:
    arrays: dict[str, Any] = {f.column: np.empty(0, f.dtype) for f in _ARRAYS}
    return RequestColumns(request_ids=[], **arrays)


def concat_column_arrays(parts: Sequence[dict[str, Any]]) -> RequestColumns:
    """Columns from parts given as :class:`RequestColumns` keyword arguments (each field a
    sequence, the request ids a list), concatenated, always copied: one object built for a
    snapshot assembled from several cached parts."""
    parts = [part for part in parts if len(part["request_ids"])]
    if not parts:
        return empty_columns()
    request_ids: list[str] = []
    for part in parts:
        request_ids.extend(part["request_ids"])
    arrays: dict[str, Any] = {
        f.column: np.concatenate([part[f.column] for part in parts]) for f in _ARRAYS
    }
    return RequestColumns(request_ids=request_ids, **arrays)


def views_from_columns(columns: RequestColumns) -> tuple[RequestView, ...]:
    """One :class:`RequestView` per row (NaN -> None), for the policies that walk views:
    built positionally, in :data:`REQUEST_FIELDS` order (RequestView's)."""
    values = [_python_values(getattr(columns, f.column), f) for f in REQUEST_FIELDS]
    return tuple(map(_new_tuple, repeat(RequestView), zip(*values, strict=True)))


_new_tuple = tuple.__new__


def _python_values(column: Any, field: RequestField) -> list[Any]:
    """A column's values as a view holds them (states as RequestState, NaN as None)."""
    if field.pack == "id":
        return list(column)
    if field.pack == "code":
        return [STATES_BY_CODE[code] for code in column.tolist()]
    if field.pack == "opt":
        return [None if math.isnan(v) else v for v in column.tolist()]
    return column.tolist()


def columnar_from_snapshot(snapshot: Snapshot) -> ColumnarSnapshot:
    return ColumnarSnapshot(
        t_now_s=snapshot.t_now_s,
        requests=columns_from_views(snapshot.requests),
        num_free_hbm_blocks=snapshot.num_free_hbm_blocks,
        num_free_dram_blocks=snapshot.num_free_dram_blocks,
        block_size=snapshot.block_size,
        max_num_batched_tokens=snapshot.max_num_batched_tokens,
        max_num_seqs=snapshot.max_num_seqs,
        b_xfer_blocks=snapshot.b_xfer_blocks,
        iteration=snapshot.iteration,
        tenant_service=snapshot.tenant_service,
        long_prefill_token_threshold=snapshot.long_prefill_token_threshold,
    )


def snapshot_from_columnar(snapshot: ColumnarSnapshot) -> Snapshot:
    return Snapshot(
        t_now_s=snapshot.t_now_s,
        requests=views_from_columns(snapshot.requests),
        num_free_hbm_blocks=snapshot.num_free_hbm_blocks,
        num_free_dram_blocks=snapshot.num_free_dram_blocks,
        block_size=snapshot.block_size,
        max_num_batched_tokens=snapshot.max_num_batched_tokens,
        max_num_seqs=snapshot.max_num_seqs,
        b_xfer_blocks=snapshot.b_xfer_blocks,
        iteration=snapshot.iteration,
        tenant_service=snapshot.tenant_service,
        long_prefill_token_threshold=snapshot.long_prefill_token_threshold,
    )
