"""The executor contract and the real executor: no torch here, so the engine loop (and the
simulator's executor) stands without it.

- :class:`BatchItem`, :class:`Executor`: the contract, defined in ``batch`` (re-exported here);
- :class:`ModelExecutor`: the real one, a :class:`~data_plane.engine.model_runner.ModelRunner`
  over the worker's HBM KV tensor (torch is imported by the runner, not by this module)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from data_plane.engine.batch import BatchItem, Executor, Sampled

if TYPE_CHECKING:
    from data_plane.engine.model_runner import ModelRunner

__all__ = ["BatchItem", "Executor", "ModelExecutor", "Sampled"]


class ModelExecutor(Executor):
    """The model on its device, writing KV into ``kv_cache`` (the HBM pool's tensor)."""

    def __init__(self, runner: ModelRunner, kv_cache: Any) -> None:
        self.runner = runner
        self.kv_cache = kv_cache

    def execute(self, items: list[BatchItem]) -> Sampled:
        return self.runner.execute(items, self.kv_cache)
