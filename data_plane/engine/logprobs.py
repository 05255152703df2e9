"""Log-probabilities on the logits' device: of each sampled token (rows that asked), and of
prompt tokens (the positions a chunk computed, for requests with ``prompt_logprobs``).

Values are ``log_softmax`` of the model's raw logits in float32 (before penalties, bias,
temperature or filters: vLLM's default ``raw_logprobs``). Rows go through in slices, so a long
prompt chunk never holds more than one slice's float32 copy of the vocabulary's logits beside
the model's own. Only the chosen values and each row's top-N come back to the host."""

from __future__ import annotations

import torch

from shared.logprobs import TokenLogprobs

# Rows of logits turned into log-probabilities at once (the float32 copy: rows x vocabulary).
ROWS_PER_SLICE = 256


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> TokenLogprobs:
    """Row i's log-probability of ``token_ids[i]``, its rank (how many tokens are at least as
    likely: vLLM's count) and the row's ``num_top[i]`` most likely tokens (most likely first),
    for the rows of ``logits``."""
    num_rows = logits.shape[0]
    if len(token_ids) != num_rows or len(num_top) != num_rows:
        raise ValueError("one token id and one top count per row of logits")
    chosen: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    for start in range(0, num_rows, ROWS_PER_SLICE):
        stop = min(num_rows, start + ROWS_PER_SLICE)
        logprobs = torch.log_softmax(logits[start:stop].float(), dim=-1)
        ids = torch.tensor(token_ids[start:stop], dtype=torch.long, device=logits.device)
        values_of_ids = logprobs.gather(1, ids.unsqueeze(1))
        chosen.extend(values_of_ids.squeeze(1).tolist())
        ranks.extend((logprobs >= values_of_ids).sum(dim=1).tolist())  # ties: vLLM's rank
        k = min(max(num_top[start:stop]), logprobs.shape[-1])
        if k > 0:
            values, indices = logprobs.topk(k, dim=-1)
            rows_values, rows_ids = values.tolist(), indices.tolist()
        else:
            rows_values = rows_ids = [[] for _ in range(stop - start)]
        for i, n in enumerate(num_top[start:stop]):
            top_ids.append(rows_ids[i][:n])
            top_values.append(rows_values[i][:n])
    return TokenLogprobs(chosen, ranks, top_ids, top_values)
