"""What the engine core hands to whatever computes a batch, and gets back (no torch here):

- :class:`BatchItem`: one request's chunk this iteration and the HBM blocks it writes;
- :class:`Executor`: runs a batch, returns the sampled token of each request that samples.

The real executor (``executor.ModelExecutor``), the model runner and the simulator's executor
all build on these, so none of them imports another for the types."""

from __future__ import annotations

from dataclasses import dataclass

from data_plane.engine.request import Request


@dataclass(slots=True)
class BatchItem:
    request: Request
    num_tokens: int  # tokens computed this iteration
    block_ids: list[int]  # the request's HBM block table, covering the new tokens


class Executor:
    """Runs one batch and returns the sampled token per request that samples."""

    def execute(self, items: list[BatchItem]) -> dict[str, int]:  # pragma: no cover
        raise NotImplementedError
