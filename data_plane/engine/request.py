"""A request inside the engine: its tokens, progress, status and timestamps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from data_plane.engine.sampling import SamplingParams
from shared.detokenizer import IncrementalDetokenizer
from shared.logprobs import TokenLogprobs, concat
from shared.policy import RequestState


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class RequestStatus(enum.IntEnum):
    """Where a request is in the engine, ordered like vLLM V1's ``RequestStatus`` (the
    finished kinds last). The engine alone changes it (``Engine._move``); the policy sees
    :attr:`Request.state` and :attr:`Request.resident`, both derived from it."""

    WAITING = 0
    LOADING = 1  # scheduled, its KV being copied in (resumed, or a DRAM prefix): not resident
    RUNNING = 2  # its KV in HBM
    ROTATING_OUT = 3  # its KV being copied out to DRAM
    ROTARY = 4  # its KV parked in DRAM
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8


_POLICY_STATE = {
    RequestStatus.WAITING: RequestState.WAITING,
    RequestStatus.LOADING: RequestState.RUNNING,
    RequestStatus.RUNNING: RequestState.RUNNING,
    RequestStatus.ROTATING_OUT: RequestState.ROTARY,
    RequestStatus.ROTARY: RequestState.ROTARY,
}
FINISHED_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}
_FINISH_REASON = {status: reason for reason, status in FINISHED_STATUS.items()}
_RESIDENT = frozenset({RequestStatus.WAITING, RequestStatus.RUNNING})
_FINISHED = frozenset(FINISHED_STATUS.values())
_S = RequestStatus
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset({_S.LOADING, _S.RUNNING}) | _FINISHED,
    _S.LOADING: frozenset({_S.RUNNING, _S.WAITING, _S.ROTATING_OUT, _S.ROTARY}) | _FINISHED,
    _S.RUNNING: frozenset({_S.WAITING, _S.ROTATING_OUT, _S.ROTARY}) | _FINISHED,
    _S.ROTATING_OUT: frozenset({_S.ROTARY}) | _FINISHED,
    _S.ROTARY: frozenset({_S.LOADING, _S.RUNNING}) | _FINISHED,
}  # the moves the engine may make; a finished request moves no more


class RequestError(ValueError):
    """A request the engine cannot serve (it fails alone; others are unaffected); ``param``:
    the request field at fault ("prompt", "stop_token_ids", ...), when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    t_arr_s: float
    arrival_seq: int
    priority: int = 0
    slo_ttft_s: float | None = None
    slo_tbt_s: float | None = None
    tenant: int = 0  # its tenant's index in the engine's TenantLedger (0: none)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at its admission
    t_run_s: float | None = None
    t_last_s: float | None = None
    t_first_token_s: float | None = None
    t_first_run_s: float | None = None  # first admitted (queue time = this - t_arr_s)
    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None  # offline text and stop strings
    num_preemptions: int = 0
    num_rotations: int = 0
    # With prefix caching: the keys of the full blocks known so far (the prompt's at arrival,
    # generated blocks as they fill), data_plane/kv/prefix_cache.py's hash chain.
    block_keys: list[int] = field(default_factory=list)
    # Never sampled before min_tokens: EOS (under ignore_eos too, as vLLM) and its
    # stop_token_ids (which of them end it: output.check_stop).
    stop_ids: tuple[int, ...] = ()
    # With params.prompt_logprobs: those of prompt tokens 1.. as computed so far, until they
    # go out with the first token (then None; a recompute after preemption adds none again).
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_prompt_logprobs: int = 0  # prompt tokens (from index 1) in prompt_logprobs
    # With params.structured: its xgrammar matcher (data_plane/engine/structured.py), advanced
    # by the engine with each token; the runner reads it for the step's allowed tokens.
    grammar: Any = None

    def record_prompt_logprobs(self, first_index: int, values: TokenLogprobs) -> None:
        """Prompt tokens ``first_index ..`` predicted by a chunk; those already recorded (a
        chunk recomputed after preemption) are skipped."""
        if self.output_token_ids:
            return
        skip = 1 + self.num_prompt_logprobs - first_index
        if skip < 0:
            raise ValueError(f"prompt logprobs from token {first_index} leave a gap")
        if skip < len(values):
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.append(values.slice(skip) if skip else values)
            self.num_prompt_logprobs += len(values) - skip

    def take_prompt_logprobs(self) -> TokenLogprobs | None:
        """The prompt's log-probabilities, once (with the first token); None when not asked
        or already taken."""
        if self.params.prompt_logprobs is None or len(self.output_token_ids) != 1:
            return None
        parts, self.prompt_logprobs = self.prompt_logprobs or [], None
        return concat(parts) if parts else TokenLogprobs()

    def output(
        self,
        token: int,
        reason: FinishReason | None,
        text_delta: str,
        logprobs: TokenLogprobs | None,
    ) -> RequestOutput:
        """The delta of the token just appended (the prompt's log-probabilities with the
        first one)."""
        return RequestOutput(
            self.request_id,
            [token],
            len(self.output_token_ids),
            reason,
            text_delta,
            t_first_run_s=self.t_first_run_s,
            num_preemptions=self.num_preemptions,
            num_rotations=self.num_rotations,
            logprobs=logprobs,
            prompt_logprobs=self.take_prompt_logprobs(),
            num_cached_tokens=self.num_cached_tokens,
        )

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether its prompt may come from the prefix cache: not when the prompt's
        log-probabilities are asked for (every prompt token is computed then)."""
        return self.params.prompt_logprobs is None

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the request needs: prompt plus generated (the last one's KV is
        written when it is fed back as the next input)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def state(self) -> RequestState:
        """The policy's view of :attr:`status` (loading counts as running, rotating out as
        rotary; ValueError once finished)."""
        state = _POLICY_STATE.get(self.status)
        if state is None:
            raise ValueError(f"request {self.request_id!r} is {self.status.name}")
        return state

    @property
    def resident(self) -> bool:
        """Its KV is where attention can read it (or it holds none yet)."""
        return self.status in _RESIDENT

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)

    @property
    def finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one iteration produced for one request (a delta, as streamed to a client)."""

    request_id: str
    new_token_ids: list[int]
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    text_delta: str = ""
    error: str | None = None
    t_first_run_s: float | None = None
    num_preemptions: int = 0
    num_rotations: int = 0
    logprobs: TokenLogprobs | None = None  # of new_token_ids, when asked for
    prompt_logprobs: TokenLogprobs | None = None  # with the first token, when asked for
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (Request's)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
