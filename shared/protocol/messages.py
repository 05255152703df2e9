"""The messages, one section per destination. Times are unix seconds (wall clock) so that
services on different hosts agree; ids and counts only, never tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.logprobs import TokenLogprobs
from shared.protocol.codec import message
from shared.protocol.table import MAX_COUNT, RequestTable, TableDelta
from shared.sampling import SamplingParams

# ---- to a worker (its request stream) ------------------------------------------------------


@message("submit")
@dataclass(frozen=True, slots=True)
class SubmitRequest:
    request_id: str
    prompt_token_ids: list[int]
    reply_stream: str  # where the worker writes this request's outputs (TokenOutputs batches)
    t_arr_s: float
    sampling: SamplingParams  # as the gateway built it; stop strings stay with the gateway
    priority: int = 0
    slo_class: str | None = None
    slo_ttft_s: float | None = None
    slo_tbt_s: float | None = None
    tenant: str | None = None  # the API key's tenant (per-tenant fairness); None: none

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id is empty")
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if not math.isfinite(self.t_arr_s):  # it would make every snapshot of its worker fail
            raise ValueError(f"t_arr_s must be finite, got {self.t_arr_s}")
        for name in ("slo_ttft_s", "slo_tbt_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")


@message("abort")
@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@message("abort_stream")
@dataclass(frozen=True, slots=True)
class AbortReplyStream:
    """A gateway restarted under its id: abort every request whose outputs go to
    ``reply_stream`` (its previous incarnation's: nobody reads them). Sent to each worker's
    request stream before the new incarnation submits anything, so the stream's order keeps
    the new incarnation's requests out of it."""

    reply_stream: str


# ---- to a worker (its plan stream) ---------------------------------------------------------


@message("plan")
@dataclass(frozen=True, slots=True)
class RotationPlan:
    """State changes for the worker's next iteration, computed from one snapshot. Requests
    are named by their handle, the ``arrival_seq`` the snapshot gave them (unique within the
    worker's epoch): ints, not the request ids, which never travel to the control plane."""

    worker_id: str
    epoch: str  # the worker incarnation the snapshot came from (plans for others are ignored)
    snapshot_iteration: int  # the snapshot it was computed from
    knobs_version: int
    policy: str
    admit_seqs: list[int]
    resume_seqs: list[int]
    rotate_out_seqs: list[int]
    preempt_seqs: list[int]
    fcfs_fallback: bool
    t_planned_s: float
    b_xfer_blocks: int  # transfer budget for the worker (B_xfer, resolved if "auto")


# ---- to the control plane (each worker's snapshot stream) --------------------------------

_SNAPSHOT_COUNTS = (
    "iteration",
    "num_free_hbm_blocks",
    "num_free_dram_blocks",
    "num_hbm_blocks",
    "num_dram_blocks",
    "block_size",
    "block_bytes",
    "max_num_batched_tokens",
    "max_num_seqs",
    "b_xfer_blocks",
    "b_xfer_queued_blocks",
    "long_prefill_token_threshold",
)
# tenant indexes a worker keeps, 0 (none) included (data_plane/engine/tenants.py)
MAX_TENANTS = 4096


@message("snapshot")
@dataclass(frozen=True, slots=True)
class StateSnapshot:
    worker_id: str
    epoch: str  # changes at every worker start, so iterations restart safely
    iteration: int
    t_now_s: float
    requests: RequestTable
    num_free_hbm_blocks: int
    num_free_dram_blocks: int
    num_hbm_blocks: int
    num_dram_blocks: int
    block_size: int
    block_bytes: int
    max_num_batched_tokens: int
    max_num_seqs: int
    b_xfer_blocks: int  # the worker's B_xfer in force (its budget, what a plan sets)
    iteration_time_s: float
    link_bytes_per_s: float  # measured rotation bandwidth (0 when unknown)
    plan_source: str  # remote | local
    # None: ``requests`` is the whole table; else it holds the rows changed since the delta's
    # base (an earlier iteration of this epoch) and the delta names every request in order.
    delta: TableDelta | None = None
    # LVF's minimum residency in force on the worker (its adaptive controller's value, or the
    # pinned knob): the control plane plans with it. None: the sender keeps none (the knob's).
    lvf_min_residency_s: float | None = None
    # Each tenant's recent service (tokens computed, decayed), indexed by the requests'
    # ``tenants`` column: what LVF's per-tenant fairness reads. Empty: no tenants.
    tenant_service: list[float] = field(default_factory=list)
    # Rotation copies queued on the worker: they use up the next budgets, so a plan may move
    # max(0, B_xfer - these) blocks (the input the worker's own LVF gets).
    b_xfer_queued_blocks: int = 0
    long_prefill_token_threshold: int = 0  # the worker's cap on one prefill chunk (0: none)

    def __post_init__(self) -> None:
        if self.delta is not None:
            if self.delta.base_iteration >= self.iteration:
                raise ValueError("a delta's base must be an earlier iteration")
            if self.requests.num_requests > self.delta.num_requests:
                raise ValueError("a delta changes more rows than the snapshot has requests")
        for name in _SNAPSHOT_COUNTS:
            value = getattr(self, name)
            if not 0 <= value <= MAX_COUNT:
                raise ValueError(f"{name} must be in 0..{MAX_COUNT}, got {value}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not math.isfinite(self.t_now_s):
            raise ValueError("t_now_s must be finite")
        for name in ("iteration_time_s", "link_bytes_per_s", "lvf_min_residency_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if len(self.tenant_service) > MAX_TENANTS or not all(
            math.isfinite(v) and v >= 0 for v in self.tenant_service
        ):
            raise ValueError("tenant_service must hold finite values >= 0")


# ---- to a gateway (its output stream) -----------------------------------------------------


ERROR_KINDS = (None, "rejected", "engine", "orphaned")


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
    t_first_run_s: float | None = None  # when the engine first scheduled it (queue time)
    num_preemptions: int = 0  # set on the final message
    num_rotations: int = 0  # set on the final message
    # with ``error``: "rejected" (the request can never be served: the client's 400),
    # "engine" (the worker failed while serving it: a 500) or "orphaned" (aborted because its
    # gateway stopped beating: a 503 if that gateway was only frozen and reads it)
    error_kind: str | None = None
    # the log-probabilities of ``token_ids`` (when the request asked for them), and on the
    # message of its first token those of its prompt tokens after the first
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    error_param: str | None = None  # with an error: the request field at fault, if one is
    num_cached_tokens: int = 0  # on the first token's message: prompt tokens the cache served

    def __post_init__(self) -> None:
        if self.error_param is not None and self.error is None:
            raise ValueError("error_param needs an error")
        if self.error_kind not in ERROR_KINDS:
            raise ValueError(f"error_kind must be one of {ERROR_KINDS}, got {self.error_kind!r}")
        if (self.error is None) != (self.error_kind is None):
            raise ValueError("error and error_kind come together")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError("logprobs and token_ids differ in length")


@message("token_batch")
@dataclass(frozen=True, slots=True)
class TokenOutputs:
    """One iteration's :class:`TokenOutput` messages for one gateway: a worker writes one
    stream entry per reply stream per iteration, not one per request (at 1,024 running
    requests, 1,024 XADDs took the worker's event loop about 15 ms an iteration)."""

    outputs: list[TokenOutput]


# ---- to gateways and operators (the workers hash, refreshed every heartbeat) -------------


@message("worker_status")
@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A worker's health and load, for routing, readiness, /metrics and the admin API."""

    worker_id: str
    epoch: str
    t_heartbeat_s: float
    model_name: str
    max_model_len: int
    num_running: int
    num_waiting: int
    num_rotary: int
    # tokens not yet computed over waiting requests: their prompts, and the output a preempted
    # one recomputes too (prefix-cache hits are known only at admission: counted)
    num_waiting_tokens: int
    num_hbm_blocks: int
    num_free_hbm_blocks: int
    num_dram_blocks: int
    num_free_dram_blocks: int
    max_num_batched_tokens: int
    iteration_time_s: float  # mean over the last heartbeat period (0 when idle)
    plan_source: str  # remote | local
    policy: str
    num_preemptions: int
    num_rotations_out: int
    num_rotations_in: int
    bytes_h2d: int
    bytes_d2h: int
    accepting: bool  # False while draining: in-flight requests finish, no new ones come
    # The minimum residency LVF plans with there (adapted online unless pinned); None: older
    # workers.
    lvf_min_residency_s: float | None = None
    # Prefix caching (vLLM's prefix_cache_queries / hits, in tokens, hits per tier) and the
    # blocks each tier's index holds.
    num_prefix_queried_tokens: int = 0
    num_prefix_hbm_hit_tokens: int = 0
    num_prefix_dram_hit_tokens: int = 0
    num_cached_hbm_blocks: int = 0
    num_cached_dram_blocks: int = 0
    # Measured speed (data_plane/speed.py), for admission and first-token deadlines: prompt
    # tokens per second of prefill steps, and a decode-only step's time; 0: not measured yet.
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    # A decode step's time as decode_base_s + decode_s_per_request x its batch size, fitted
    # over recent decode steps (data_plane/speed.py); both 0: not measured yet.
    decode_base_s: float = 0.0
    decode_s_per_request: float = 0.0
    # DuplexKV's budget in force (B_xfer, blocks per iteration per direction: the knob, or with
    # ``auto`` what the measured link moves in an iteration) and the measured link bandwidth
    # (the slower direction, bytes per busy second; 0: nothing measured or no host tier).
    b_xfer_blocks: int = 0
    link_bytes_per_s: float = 0.0
