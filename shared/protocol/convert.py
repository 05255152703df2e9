"""Policy views <-> wire rows, both directions in one place (the worker encodes, the control
plane decodes; a field added to one side must be added here)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import structlog

from shared.policy import RequestState, RequestView
from shared.protocol.codec import ProtocolError, decode
from shared.protocol.messages import RequestRow

log = structlog.get_logger(__name__)
T = TypeVar("T")


def row_from_view(view: RequestView, num_blocks_synced: int) -> RequestRow:
    return RequestRow(
        request_id=view.request_id,
        state=view.state.value,
        t_arr_s=view.t_arr_s,
        t_run_s=view.t_run_s,
        t_last_s=view.t_last_s,
        num_tokens=view.num_tokens,
        num_computed_tokens=view.num_computed_tokens,
        num_blocks_hbm=view.num_blocks_hbm,
        num_blocks_dram=view.num_blocks_dram,
        num_blocks_synced=num_blocks_synced,
        priority=view.priority,
        slo_ttft_s=view.slo_ttft_s,
        slo_tbt_s=view.slo_tbt_s,
        resident=view.resident,
        arrival_seq=view.arrival_seq,
    )


def view_from_row(row: RequestRow) -> RequestView:
    """Raises ValueError for an unknown state string."""
    return RequestView(
        request_id=row.request_id,
        state=RequestState(row.state),
        t_arr_s=row.t_arr_s,
        num_tokens=row.num_tokens,
        num_computed_tokens=row.num_computed_tokens,
        num_blocks_hbm=row.num_blocks_hbm,
        num_blocks_dram=row.num_blocks_dram,
        t_run_s=row.t_run_s,
        t_last_s=row.t_last_s,
        priority=row.priority,
        arrival_seq=row.arrival_seq,
        slo_ttft_s=row.slo_ttft_s,
        slo_tbt_s=row.slo_tbt_s,
        resident=row.resident,
    )


def stream_messages(response: Any, expected: type[T], event: str) -> Iterator[tuple[Any, T | None]]:
    """(entry id, message) for each entry of an XREAD/XREADGROUP response; a malformed entry
    is logged under ``event`` and yields None (the caller counts or acknowledges it)."""
    for _, entries in response or []:
        for entry_id, fields in entries:
            try:
                yield entry_id, decode(fields.get(b"m", b""), expected)
            except ProtocolError as exc:
                log.error(event, entry_id=entry_id, error=str(exc))
                yield entry_id, None
