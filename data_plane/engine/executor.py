"""What the engine core hands to whatever computes a batch, and gets back: no torch here, so the
engine loop (and the simulator's executor) stands without it.

- :class:`BatchItem`: one request's chunk this iteration and the HBM blocks it writes;
- :class:`Executor`: runs a batch, returns the sampled token of each request that samples;
- :class:`ModelExecutor`: the real one, a :class:`~data_plane.engine.model_runner.ModelRunner`
  over the worker's HBM KV tensor (torch is imported by the runner, not by this module)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from data_plane.engine.request import Request

if TYPE_CHECKING:
    from data_plane.engine.model_runner import ModelRunner


@dataclass(slots=True)
class BatchItem:
    request: Request
    num_tokens: int  # tokens computed this iteration
    block_ids: list[int]  # the request's HBM block table, covering the new tokens


class Executor:
    """Runs one batch and returns the sampled token per request that samples."""

    def execute(self, items: list[BatchItem]) -> dict[str, int]:  # pragma: no cover
        raise NotImplementedError


class ModelExecutor(Executor):
    """The model on its device, writing KV into ``kv_cache`` (the HBM pool's tensor)."""

    def __init__(self, runner: ModelRunner, kv_cache: Any) -> None:
        self.runner = runner
        self.kv_cache = kv_cache

    def execute(self, items: list[BatchItem]) -> dict[str, int]:
        return self.runner.execute(items, self.kv_cache)
