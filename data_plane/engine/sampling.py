"""The sampler's rows: plain data, no torch (the sampler itself is ``sampler.py``). The
parameters are :class:`shared.sampling.SamplingParams`, one type from the gateway to here."""

from __future__ import annotations

from dataclasses import dataclass

from shared.sampling import SamplingParams

__all__ = ["SamplingParams", "SamplingRow"]


@dataclass(slots=True)
class SamplingRow:
    """One sequence to sample: its params, its output position and the tokens it must not
    sample now (its stop tokens, while under ``min_tokens``)."""

    params: SamplingParams
    output_index: int  # how many tokens the request has generated so far
    suppressed_ids: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, params: SamplingParams, output_index: int, stop_ids: tuple[int, ...]
    ) -> SamplingRow:
        suppressed = stop_ids if output_index < params.min_tokens else ()
        return cls(params, output_index, suppressed)
