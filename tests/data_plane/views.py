"""A request's policy view built field by field, by name: the reference the engine's
positional, cached views are checked against."""

from __future__ import annotations

from data_plane.engine.request import Request
from shared.policy import RequestView


def view_by_name(
    request: Request, *, num_blocks_hbm: int = 0, num_blocks_dram: int = 0, resident: bool = True
) -> RequestView:
    return RequestView(
        request_id=request.request_id,
        state=request.state,
        t_arr_s=request.t_arr_s,
        num_tokens=request.num_tokens,
        num_computed_tokens=request.num_computed_tokens,
        num_blocks_hbm=num_blocks_hbm,
        num_blocks_dram=num_blocks_dram,
        t_run_s=request.t_run_s,
        t_last_s=request.t_last_s,
        priority=request.priority,
        arrival_seq=request.arrival_seq,
        slo_ttft_s=request.slo_ttft_s,
        slo_tbt_s=request.slo_tbt_s,
        resident=resident,
        tenant=request.tenant,
        t_first_s=request.t_first_token_s,
        num_output_tokens=len(request.output_token_ids),
    )
