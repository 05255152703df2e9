"""A request inside the engine: its tokens, progress, state and timestamps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from data_plane.engine.sampling import SamplingParams
from shared.detokenizer import IncrementalDetokenizer
from shared.policy import RequestState


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class RequestError(ValueError):
    """A request the engine cannot serve (it fails alone; others are unaffected)."""


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
    output_token_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0
    t_run_s: float | None = None
    t_last_s: float | None = None
    t_first_token_s: float | None = None
    t_first_run_s: float | None = None  # first admitted (queue time = this - t_arr_s)
    finish_reason: FinishReason | None = None
    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None  # offline text and stop strings
    num_preemptions: int = 0
    num_rotations: int = 0
    # With prefix caching: the keys of the full blocks known so far (the prompt's at arrival,
    # generated blocks as they fill), data_plane/kv/prefix_cache.py's hash chain.
    block_keys: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the request needs: prompt plus generated (the last one's KV is
        written when it is fed back as the next input)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
