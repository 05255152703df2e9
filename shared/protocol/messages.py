"""The messages, one section per destination. Times are unix seconds (wall clock) so that
services on different hosts agree; ids and counts only, never tensors."""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol.codec import message

# ---- to a worker (its request stream) ------------------------------------------------------


@message("submit")
@dataclass(frozen=True, slots=True)
class SubmitRequest:
    request_id: str
    prompt_token_ids: list[int]
    reply_stream: str  # where the worker writes this request's TokenOutput messages
    t_arr_s: float
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    priority: int = 0
    slo_class: str | None = None
    slo_ttft_s: float | None = None
    slo_tbt_s: float | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id is empty")
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")


@message("abort")
@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


# ---- to a worker (its plan stream) ---------------------------------------------------------


@message("plan")
@dataclass(frozen=True, slots=True)
class RotationPlan:
    """State changes for the worker's next iteration, computed from one snapshot."""

    worker_id: str
    epoch: str  # the worker incarnation the snapshot came from (plans for others are ignored)
    snapshot_iteration: int  # the snapshot it was computed from
    knobs_version: int
    policy: str
    admit_ids: list[str]
    resume_ids: list[str]
    rotate_out_ids: list[str]
    preempt_ids: list[str]
    fcfs_fallback: bool
    t_planned_s: float
    b_xfer_blocks: int  # transfer budget for the worker (B_xfer, resolved if "auto")


# ---- to the control plane (the snapshots stream) ------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestRow:
    request_id: str
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


@message("snapshot")
@dataclass(frozen=True, slots=True)
class StateSnapshot:
    worker_id: str
    epoch: str  # changes at every worker start, so iterations restart safely
    iteration: int
    t_now_s: float
    requests: list[RequestRow]
    num_free_hbm_blocks: int
    num_free_dram_blocks: int
    num_hbm_blocks: int
    num_dram_blocks: int
    block_size: int
    block_bytes: int
    max_num_batched_tokens: int
    max_num_seqs: int
    b_xfer_blocks: int
    iteration_time_s: float
    link_bytes_per_s: float  # measured rotation bandwidth (0 when unknown)
    plan_source: str  # remote | local


# ---- to a gateway (its output stream) -----------------------------------------------------


@message("tokens")
@dataclass(frozen=True, slots=True)
class TokenOutput:
    """Tokens ``token_ids`` are output positions ``index .. index+len-1`` of the request, so a
    receiver drops duplicates after a redelivery."""

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
