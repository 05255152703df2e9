"""What the engine core hands to whatever computes a batch, and gets back (no torch here):

- :class:`BatchItem`: one request's chunk this iteration and the HBM blocks it writes;
- :class:`Executor`: runs a batch, returns :class:`Sampled`: the sampled token of each request
  that samples, and the log-probabilities requests asked for.

The real executor (``executor.ModelExecutor``), the model runner and the simulator's executor
all build on these, so none of them imports another for the types."""

from __future__ import annotations

from dataclasses import dataclass, field

from data_plane.engine.request import Request
from shared.logprobs import TokenLogprobs


@dataclass(slots=True)
class BatchItem:
    request: Request
    num_tokens: int  # tokens computed this iteration
    block_ids: list[int]  # the request's HBM block table, covering the new tokens


@dataclass(slots=True)
class Sampled:
    """One batch's results. ``token_ids``: the sampled token of each request whose chunk
    reached the end of its known tokens; ``logprobs``: those tokens' log-probabilities, for
    requests with ``params.logprobs``; ``prompt_logprobs``: for requests with
    ``params.prompt_logprobs`` and no output yet, (index of the first prompt token predicted,
    the log-probabilities of the prompt tokens this chunk predicted, in order)."""

    token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, TokenLogprobs]] = field(default_factory=dict)


class Executor:
    """Runs one batch and returns what it sampled."""

    def execute(self, items: list[BatchItem]) -> Sampled:  # pragma: no cover
        raise NotImplementedError
