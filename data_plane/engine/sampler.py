"""The sampler: one token per row, for the whole batch at once on the logits' device.

Logit bias and penalties (:mod:`data_plane.engine.penalties`), ``min_tokens`` (a row's stop
tokens masked until it has generated that many), greedy, temperature, min-p, top-k and top-p
(vLLM's order) are batched tensor ops with no Python loop over rows' logits and no host copy
of the logits; only the chosen ids come back. On a GPU a draw is the exponential race
(argmax of p / q, q ~ Exp(1): the multinomial's distribution with no host sync), on the CPU
the inverse of each row's cumulative distribution (one random number a row). Unseeded rows
draw from the sampler's generator in one call for the batch; a seeded row from a generator
seeded by (seed, output position), so its tokens do not depend on the batch or on
preemption. Python loops only gather ids: seeded rows, stop tokens, penalized rows' tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from data_plane.engine.penalties import apply_penalties
from data_plane.engine.sampling import SamplingRow

_SEED_MIX = 1_000_003
# Below this temperature sampling is greedy (as vLLM does): dividing logits by a tinier one
# overflows to inf and the softmax to NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
_SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class Sampler:
    """Samples one token per row (see the module docstring)."""

    # the unseeded rows' noise, created on the logits' device at the first sampled batch
    generators: dict[torch.device, torch.Generator] = field(default_factory=dict)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        logits = _mask_stop_tokens(apply_penalties(logits, rows), rows)
        greedy = [row.params.temperature < GREEDY_BELOW_TEMPERATURE for row in rows]
        if all(greedy):
            return [int(t) for t in logits.argmax(dim=-1).tolist()]
        probs = _filtered_probs(logits, rows, greedy)
        seeds = [None if g else row.params.seed for row, g in zip(rows, greedy, strict=True)]
        generator = self._generator(probs.device)
        if probs.is_cuda:
            sampled = _exponential_race(probs, rows, seeds, generator)
        else:
            sampled = _inverse_cdf(probs, rows, seeds, generator)
        if any(greedy):
            is_greedy = torch.tensor(greedy, device=logits.device)
            sampled = torch.where(is_greedy, logits.argmax(dim=-1), sampled)
        return [int(t) for t in sampled.tolist()]

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self.generators.get(device)
        if generator is None:
            generator = self.generators[device] = torch.Generator(device=device)
            generator.seed()
        return generator


def _seeded(row: SamplingRow, seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * _SEED_MIX + row.output_index) & _SEED_MASK)
    return generator


def _exponential_race(
    probs: torch.Tensor,
    rows: list[SamplingRow],
    seeds: list[int | None],
    generator: torch.Generator,
) -> torch.Tensor:
    """argmax of p / q, q ~ Exp(1) per token: no host sync (the GPU's draw)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for i, seed in enumerate(seeds):
        if seed is not None:
            noise[i].exponential_(generator=_seeded(rows[i], seed, probs.device))
    # a 0 draw (older CUDA builds' exponential_ could give one) would make 0 / 0 = NaN, which
    # argmax takes as the largest: a masked token chosen
    return (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def _inverse_cdf(
    probs: torch.Tensor,
    rows: list[SamplingRow],
    seeds: list[int | None],
    generator: torch.Generator,
) -> torch.Tensor:
    """One uniform number a row against the row's cumulative distribution (the CPU's draw:
    torch.multinomial over a batch was slower there than one row at a time). Float64 sums;
    ``1 - U[0, 1)`` is never 0, so a token of probability 0 is never the first >= it."""
    cdf = probs.double().cumsum(dim=-1)
    uniform = 1.0 - torch.rand(len(seeds), generator=generator, dtype=torch.float64)
    for i, seed in enumerate(seeds):
        if seed is not None:
            seeded = _seeded(rows[i], seed, probs.device)
            uniform[i] = 1.0 - torch.rand(1, generator=seeded, dtype=torch.float64)[0]
    targets = (uniform.to(probs.device) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, targets).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _mask_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``logits`` with each row's ``suppressed_ids`` at -inf (a copy when any are)."""
    row_index = [i for i, row in enumerate(rows) for _ in row.suppressed_ids]
    if not row_index:
        return logits
    token_index = [t for row in rows for t in row.suppressed_ids]
    masked = logits.clone()
    masked[row_index, token_index] = float("-inf")
    return masked


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _filtered_probs(
    logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]
) -> torch.Tensor:
    """Each row's distribution after temperature, min-p, top-k and top-p, in vLLM's order
    (float32)."""
    device, vocab = logits.device, logits.shape[-1]
    params = [row.params for row in rows]
    temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
    scaled = logits.float() / _column(temperatures, device)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        probs = torch.softmax(scaled, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * _column(min_p, device)
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    top_k = [vocab if p.top_k is None else min(p.top_k, vocab) for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        scaled = _top_k_top_p(scaled, top_k, top_p)
    return torch.softmax(scaled, dim=-1)


def _top_k_top_p(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Logits under each row's k-th largest (ties kept), then those whose mass, summed from
    the least likely up, stays within ``1 - top_p`` (the most likely always kept), at -inf:
    one ascending sort for the batch, vLLM's rule. A row with ``top_p`` 1 loses only tokens
    of probability 0, whatever the other rows ask."""
    device, vocab = scaled.device, scaled.shape[-1]
    ordered, order = scaled.sort(dim=-1)
    if any(k < vocab for k in top_k):
        first_kept = torch.tensor([vocab - k for k in top_k], device=device).unsqueeze(1)
        ordered = ordered.masked_fill(ordered < ordered.gather(1, first_kept), float("-inf"))
    if any(p < 1.0 for p in top_p):
        mass_up_to = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        dropped = mass_up_to <= 1.0 - _column(top_p, device)
        dropped[:, -1] = False
        ordered = ordered.masked_fill(dropped, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, ordered)
