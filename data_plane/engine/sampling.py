"""The sampler's rows: plain data, no torch (the sampler itself is ``sampler.py``). The
parameters are :class:`shared.sampling.SamplingParams`, one type from the gateway to here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.sampling import SamplingParams

__all__ = ["SamplingParams", "SamplingRow"]


@dataclass(slots=True)
class SamplingRow:
    """One sequence to sample: its params, its output position, the tokens it must not
    sample now (its stop tokens, while under ``min_tokens``) and, for the penalties, its
    prompt and output tokens (the request's own lists, not copied)."""

    params: SamplingParams
    output_index: int  # how many tokens the request has generated so far
    suppressed_ids: tuple[int, ...] = ()
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()

    @classmethod
    def of(
        cls,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        stop_ids: tuple[int, ...],
    ) -> SamplingRow:
        num_output = len(output_ids)
        suppressed = stop_ids if num_output < params.min_tokens else ()
        if not params.penalized:
            return cls(params, num_output, suppressed)
        return cls(params, num_output, suppressed, prompt_ids, output_ids)
