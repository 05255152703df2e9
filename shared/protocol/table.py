"""A snapshot's requests as packed columns (:class:`RequestTable`), one request as plain
values (:class:`RequestRow`) and the table as changes to an earlier one (:class:`TableDelta`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from shared.policy.types import REQUEST_FIELDS

MAX_COUNT = 2**53  # the policy does numpy int64 arithmetic with counts and iterations

# RequestTable's packed columns, in field order, and how each is packed (little-endian):
#   code: uint8 per request (states: 0 waiting, 1 running, 2 rotary)
#   time: float64, finite (t_arr_s)
#   opt:  float64, NaN where unknown; empty when unknown for every request
#   int:  signed integers of 1, 2, 4 or 8 bytes, the smallest width that holds them all (the
#         width follows from the length); empty when all are 0
#   flag: uint8 0/1; empty when all are 1
# ``states`` has one byte per request: its length is the number of requests.
# The kinds come from the one declaration of a request's fields
# (:data:`shared.policy.types.REQUEST_FIELDS`) plus what only the wire carries; the order is
# RequestTable's (``TABLE_COLUMNS``, built after it and checked against both).
WIRE_ONLY_COLUMNS = {"num_blocks_synced": "int"}  # blocks whose DRAM copy is current
COLUMN_WIDTHS = {"code": (1,), "time": (8,), "opt": (0, 8), "int": (0, 1, 2, 4, 8), "flag": (0, 1)}
_INT_DTYPES = {1: "<i1", 2: "<i2", 4: "<i4", 8: "<i8"}
_NUM_STATES = 3
_COUNTS = ("num_tokens", "num_computed_tokens", "num_blocks_hbm", "num_blocks_dram")


@dataclass(frozen=True, slots=True)
class RequestTable:
    """Every request of a snapshot as columns: one packed array per field (``TABLE_COLUMNS``;
    row i of every column is request i), so that neither side builds a per-request object
    (``shared.protocol.convert``). A request is known by its handle, ``arrival_seq``: its id
    string stays on the worker (at 4,096 requests the ids were about half the bytes). Validated
    when built, so on decode: column sizes, known state codes, 0/1 flags, finite arrival times,
    no infinite optional time or SLO, non-negative counts and handles. Handles are assumed
    unique (a worker's are)."""

    states: bytes
    t_arr_s: bytes
    t_run_s: bytes
    t_last_s: bytes
    slo_ttft_s: bytes
    slo_tbt_s: bytes
    num_tokens: bytes
    num_computed_tokens: bytes
    num_blocks_hbm: bytes
    num_blocks_dram: bytes
    num_blocks_synced: bytes
    priority: bytes
    arrival_seq: bytes
    resident: bytes
    tenants: bytes = b""  # a request's tenant index (0: none): StateSnapshot.tenant_service
    t_first_s: bytes = b""  # its first output token's time (NaN: none yet)
    num_output_tokens: bytes = b""

    def __post_init__(self) -> None:
        num = self.num_requests
        for name, kind in TABLE_COLUMNS.items():
            size = len(getattr(self, name))
            width, extra = divmod(size, num) if num else (0, size)
            if extra or (num and width not in COLUMN_WIDTHS[kind]):
                raise ValueError(f"column {name} has {size} bytes for {num} requests")
        if num:
            self._check_values()

    @property
    def num_requests(self) -> int:
        return len(self.states)

    def _check_values(self) -> None:
        if self.column("states").max() >= _NUM_STATES:
            raise ValueError("unknown state code in states")
        if self.resident and np.frombuffer(self.resident, np.uint8).max() > 1:
            raise ValueError("resident must be 0 or 1")
        if not np.isfinite(self.column("t_arr_s")).all():
            raise ValueError("t_arr_s must be finite")
        for name in ("t_run_s", "t_last_s", "slo_ttft_s", "slo_tbt_s", "t_first_s"):
            if np.isinf(self.column(name)).any():
                raise ValueError(f"{name} must be finite or NaN (unknown)")
        for name in (*_COUNTS, "num_blocks_synced", "arrival_seq", "num_output_tokens"):
            data: bytes = getattr(self, name)  # packed at its own width: no int64 copy
            if data and np.frombuffer(data, _INT_DTYPES[len(data) // self.num_requests]).min() < 0:
                raise ValueError(f"{name} must be >= 0")

    def column(self, name: str) -> np.ndarray:
        """Column ``name`` unpacked: uint8 codes, float64 (NaN: unknown), int64 or bool."""
        data: bytes = getattr(self, name)
        kind, num = TABLE_COLUMNS[name], self.num_requests
        if kind == "int":
            if not data:
                return np.zeros(num, np.int64)
            return np.frombuffer(data, _INT_DTYPES[len(data) // num]).astype(np.int64)
        if kind == "flag":
            return np.frombuffer(data, np.uint8).view(np.bool_) if data else np.ones(num, bool)
        if kind == "code":
            return np.frombuffer(data, np.uint8)
        return np.frombuffer(data, "<f8") if data else np.full(num, np.nan)


@dataclass(frozen=True, slots=True)
class RequestRow:
    """One request of a :class:`RequestTable`, as plain values (tests, debugging, tools;
    ``shared.protocol.convert.rows_from_table`` / ``table_from_rows``)."""

    state: str  # waiting | running | rotary
    t_arr_s: float
    t_run_s: float | None
    t_last_s: float | None
    num_tokens: int
    num_computed_tokens: int
    num_blocks_hbm: int
    num_blocks_dram: int
    num_blocks_synced: int
    priority: int
    slo_ttft_s: float | None
    slo_tbt_s: float | None
    resident: bool
    arrival_seq: int
    tenants: int = 0
    t_first_s: float | None = None
    num_output_tokens: int = 0


def _table_columns() -> dict[str, str]:
    """RequestTable's columns and kinds; TypeError if RequestTable or RequestRow disagree with
    REQUEST_FIELDS (a field added in one place only)."""
    kinds = {f.column: f.pack for f in REQUEST_FIELDS if f.pack != "id"} | WIRE_ONLY_COLUMNS
    table = [f.name for f in fields(RequestTable)]
    if sorted(table) != sorted(kinds):
        raise TypeError(f"RequestTable's columns {table} are not REQUEST_FIELDS' {sorted(kinds)}")
    rows = {f.name for f in fields(RequestRow)}
    if rows != (set(kinds) - {"states"}) | {"state"}:
        raise TypeError(f"RequestRow's fields {sorted(rows)} are not RequestTable's")
    return {name: kinds[name] for name in table}


TABLE_COLUMNS: dict[str, str] = _table_columns()


@dataclass(frozen=True, slots=True)
class TableDelta:
    """A snapshot's requests as changes to an earlier snapshot of the same worker epoch, its
    *base* (one the control plane planned, so it holds that table). ``base_rows`` has one
    packed signed little-endian int per request, in this snapshot's order (width
    ``len(base_rows) // num_requests``): the base row this request's row repeats unchanged,
    or -1 for the next of the snapshot's ``requests``, which hold only the new and changed rows
    (``shared.protocol.delta``)."""

    base_iteration: int
    num_requests: int
    base_rows: bytes

    def __post_init__(self) -> None:
        if not 0 <= self.base_iteration <= MAX_COUNT:
            raise ValueError(f"base_iteration must be in 0..{MAX_COUNT}")
        num, size = self.num_requests, len(self.base_rows)
        width, extra = divmod(size, num) if num > 0 else (0, size)
        if num < 0 or extra or (num and width not in _INT_DTYPES):
            raise ValueError(f"base_rows has {size} bytes for {num} requests")
        if num and self.rows().min() < -1:
            raise ValueError("base_rows must be >= -1")

    def rows(self) -> np.ndarray:
        """Each request's base row (-1: a changed row), as int64."""
        if not self.num_requests:
            return np.zeros(0, np.int64)
        width = len(self.base_rows) // self.num_requests
        return np.frombuffer(self.base_rows, _INT_DTYPES[width]).astype(np.int64)
