"""The sampler: one token per row (greedy, temperature, top-k, top-p, per-request seed)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from data_plane.engine.sampling import SamplingRow

_SEED_MIX = 1_000_003
# Below this temperature sampling is greedy (as vLLM does): dividing logits by a tinier one
# overflows to inf and the softmax to NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
_SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class Sampler:
    """Samples one token per row. A seeded request draws from a generator seeded by
    (seed, output position), so its tokens do not depend on the batch or on preemption."""

    generator: torch.Generator = field(default_factory=torch.Generator)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        greedy = [
            i for i, row in enumerate(rows) if row.params.temperature < GREEDY_BELOW_TEMPERATURE
        ]
        tokens = [0] * len(rows)
        if greedy:
            picked = logits[greedy].argmax(dim=-1).tolist()
            for i, token in zip(greedy, picked, strict=True):
                tokens[i] = int(token)
        for i, row in enumerate(rows):
            if row.params.temperature >= GREEDY_BELOW_TEMPERATURE:
                tokens[i] = self._sample_row(logits[i], row)
        return tokens

    def _sample_row(self, logits: torch.Tensor, row: SamplingRow) -> int:
        params = row.params
        scaled = logits.float().cpu() / params.temperature
        if params.top_k is not None and params.top_k < scaled.numel():
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(0)
            drop = cumulative - sorted_probs > params.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        generator = self.generator
        if params.seed is not None:
            generator = torch.Generator().manual_seed(
                (params.seed * _SEED_MIX + row.output_index) & _SEED_MASK
            )
        return int(torch.multinomial(probs, 1, generator=generator).item())
