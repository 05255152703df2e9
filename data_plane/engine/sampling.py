"""The sampler's rows: plain data, no torch (the sampler itself is ``sampler.py``). The
parameters are :class:`shared.sampling.SamplingParams`, one type from the gateway to here."""

from __future__ import annotations

from dataclasses import dataclass

from shared.sampling import SamplingParams

__all__ = ["SamplingParams", "SamplingRow"]


@dataclass(slots=True)
class SamplingRow:
    """One sequence to sample: its logits row index, params and output position."""

    params: SamplingParams
    output_index: int  # how many tokens the request has generated so far
