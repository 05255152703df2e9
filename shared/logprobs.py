"""Log-probabilities as they travel from the worker to the gateway: plain data, no torch.

Values are of the model's raw distribution (``log_softmax`` of its logits in float32, before
penalties, bias, temperature or any filter: vLLM's default), computed on the worker's device;
only the numbers asked for come back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The most top log-probabilities a request may ask for per position (vLLM's max_logprobs and
# OpenAI's chat top_logprobs bound: 20).
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Consecutive positions as columns: ``logprobs[i]`` is the log-probability of position
    i's token (sampled, or the prompt's), ``ranks[i]`` its rank there (1: the most likely),
    ``top_ids[i]`` / ``top_logprobs[i]`` the most likely tokens there, most likely first (as
    many as asked for; none when 0)."""

    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        num = len(self.logprobs)
        if not len(self.ranks) == len(self.top_ids) == len(self.top_logprobs) == num:
            raise ValueError("logprobs, ranks, top_ids and top_logprobs differ in length")
        if any(r < 1 for r in self.ranks):
            raise ValueError("a rank is >= 1")
        if any(len(i) != len(v) for i, v in zip(self.top_ids, self.top_logprobs, strict=True)):
            raise ValueError("a position's top_ids and top_logprobs differ in length")
        if any(len(ids) > MAX_LOGPROBS for ids in self.top_ids):
            raise ValueError(f"at most {MAX_LOGPROBS} top log-probabilities a position")
        if any(math.isnan(v) or v > 0.0 for v in self.logprobs):
            raise ValueError("a log-probability is <= 0 (or -inf)")

    def __len__(self) -> int:
        return len(self.logprobs)

    def slice(self, start: int, stop: int | None = None) -> TokenLogprobs:
        return TokenLogprobs(
            self.logprobs[start:stop],
            self.ranks[start:stop],
            self.top_ids[start:stop],
            self.top_logprobs[start:stop],
        )


def concat(parts: list[TokenLogprobs]) -> TokenLogprobs:
    """``parts`` one after the other."""
    if len(parts) == 1:
        return parts[0]
    return TokenLogprobs(
        [v for p in parts for v in p.logprobs],
        [r for p in parts for r in p.ranks],
        [ids for p in parts for ids in p.top_ids],
        [values for p in parts for values in p.top_logprobs],
    )
