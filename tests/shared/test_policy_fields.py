"""The request's fields are declared once (shared.policy.types.REQUEST_FIELDS): the view, the
columns and their conversions follow it, and a class that drifts from it fails at import."""

from __future__ import annotations

from dataclasses import fields
from typing import NamedTuple

import numpy as np
import pytest

from shared.policy import RequestColumns, RequestState, RequestView, columns_from_views
from shared.policy.columns import FLOAT_FIELDS, INT_FIELDS, empty_columns, views_from_columns
from shared.policy.types import REQUEST_FIELDS, check_view_fields, compile_view_builder


def test_the_view_and_the_columns_are_the_declared_fields() -> None:
    assert RequestView._fields == tuple(f.name for f in REQUEST_FIELDS)
    assert {f.name for f in fields(RequestColumns)} == {f.column for f in REQUEST_FIELDS}
    floats = ("t_arr_s", "t_run_s", "t_last_s", "slo_ttft_s", "slo_tbt_s", "t_first_s")
    assert floats == FLOAT_FIELDS
    assert INT_FIELDS == (
        "num_tokens",
        "num_computed_tokens",
        "num_blocks_hbm",
        "num_blocks_dram",
        "priority",
        "arrival_seq",
        "tenants",
        "num_output_tokens",
    )


def test_columns_have_the_declared_dtypes() -> None:
    view = RequestView("a", RequestState.ROTARY, 1.0, 5, 4, 0, 1, t_last_s=2.0, resident=False)
    for columns in (columns_from_views([view]), empty_columns()):
        for field in REQUEST_FIELDS:
            if field.pack != "id":
                assert getattr(columns, field.column).dtype == np.dtype(field.dtype), field
    assert views_from_columns(columns_from_views([view])) == (view,)


def test_a_view_type_that_drifts_from_the_declaration_is_refused() -> None:
    class Swapped(NamedTuple):  # two fields out of order
        state: RequestState
        request_id: str

    with pytest.raises(TypeError, match="REQUEST_FIELDS"):
        check_view_fields(Swapped)

    retyped = {**RequestView.__annotations__, "priority": "float"}
    Retyped = NamedTuple("Retyped", list(retyped.items()))  # type: ignore[misc]
    with pytest.raises(TypeError, match="REQUEST_FIELDS"):
        check_view_fields(Retyped)


def test_the_wire_table_follows_the_declaration(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wire's request columns and their kinds come from REQUEST_FIELDS (plus the wire's
    own synced count); a field declared but not carried by the wire table fails at import."""
    from shared.policy.types import REQUEST_FIELDS, RequestField
    from shared.protocol import table

    for field in REQUEST_FIELDS:
        if field.pack != "id":
            assert table.TABLE_COLUMNS[field.column] == field.pack
    assert set(table.TABLE_COLUMNS) - {f.column for f in REQUEST_FIELDS} == {"num_blocks_synced"}
    drifted = (*REQUEST_FIELDS, RequestField("tenant_rank", "tenant_rank", "int64", "int"))
    monkeypatch.setattr(table, "REQUEST_FIELDS", drifted)
    with pytest.raises(TypeError, match="RequestTable"):
        table._table_columns()


def test_a_compiled_view_builder_covers_every_field_or_is_refused() -> None:
    """The engine's views come from one expression per field (compiled positional build): a
    field left out or one that is not declared fails when compiled, and the build matches
    keyword construction."""
    sources = {f.name: f"values[{f.name!r}]" for f in REQUEST_FIELDS}
    build = compile_view_builder(sources, ("values",))
    values = {
        "request_id": "r",
        "state": RequestState.RUNNING,
        "t_arr_s": 1.5,
        "num_tokens": 9,
        "num_computed_tokens": 8,
        "num_blocks_hbm": 2,
        "num_blocks_dram": 1,
        "t_run_s": 2.0,
        "t_last_s": None,
        "priority": -3,
        "arrival_seq": 7,
        "slo_ttft_s": 0.5,
        "slo_tbt_s": None,
        "resident": False,
        "tenant": 4,
        "t_first_s": 1.5,
        "num_output_tokens": 3,
    }
    assert build(values) == RequestView(**values)
    missing = {k: v for k, v in sources.items() if k != "priority"}
    with pytest.raises(TypeError, match="missing \\['priority'\\]"):
        compile_view_builder(missing, ("values",))
    with pytest.raises(TypeError, match="not REQUEST_FIELDS \\['owner'\\]"):
        compile_view_builder({**sources, "owner": "None"}, ("values",))
