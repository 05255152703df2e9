"""Logit bias and penalties over a batch of logits rows (before temperature), in vLLM's order:
logit_bias first, then the repetition penalty over each row's prompt and generated tokens
(transformers' and vLLM's rule), then OpenAI's frequency and presence penalties over its
generated tokens. Only the rows that ask for one are touched; their token lists become one
padded index tensor each."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from data_plane.engine.sampling import SamplingRow


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``logits`` with every row's bias and penalties applied (a copy when any row has one)."""
    index = [i for i, row in enumerate(rows) if row.params.penalized]
    if not index:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    chosen = [rows[i] for i in index]
    sub = logits[index].float()
    params = [row.params for row in chosen]
    bias_rows = [k for k, p in enumerate(params) for _ in p.logit_bias_ids]
    if bias_rows:
        bias_ids = [t for p in params for t in p.logit_bias_ids]
        bias_values = torch.tensor([v for p in params for v in p.logit_bias_values], device=device)
        sub.index_put_(
            (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device)),
            bias_values,
            accumulate=True,
        )
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        seen = _counts([[*r.prompt_ids, *r.output_ids] for r in chosen], vocab, device) > 0
        factor = torch.tensor(repetition, device=device).unsqueeze(1)
        penalized = torch.where(sub > 0, sub / factor, sub * factor)
        sub = torch.where(seen, penalized, sub)
    frequency = [p.frequency_penalty for p in params]
    presence = [p.presence_penalty for p in params]
    if any(frequency) or any(presence):
        counts = _counts([r.output_ids for r in chosen], vocab, device)
        sub -= torch.tensor(frequency, device=device).unsqueeze(1) * counts
        sub -= torch.tensor(presence, device=device).unsqueeze(1) * (counts > 0)
    out = logits.clone()
    out[index] = sub.to(logits.dtype)
    return out


def _counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's list, as a (rows, vocab) float tensor."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab, device=device)
    if width == 0:
        return counts
    ids = torch.zeros(len(token_lists), width, dtype=torch.long)
    weights = torch.zeros(len(token_lists), width)
    for k, tokens in enumerate(token_lists):
        if tokens:
            ids[k, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
            weights[k, : len(tokens)] = 1.0
    return counts.scatter_add_(1, ids.to(device), weights.to(device))
