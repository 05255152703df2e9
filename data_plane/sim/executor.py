"""An executor that runs no model: it charges the cost model's iteration time to the virtual
clock and samples a dummy token for every request whose chunk reached its last known token."""

from __future__ import annotations

from data_plane.engine.engine import Executor
from data_plane.engine.model_runner import BatchItem
from data_plane.sim.clock import VirtualClock
from shared.costmodel import CostProfile, iteration_time_s

DUMMY_TOKEN = 3


class SimulatedExecutor(Executor):
    """``execute`` advances ``clock`` by ``iteration_time_s(profile, prefill tokens, decode
    sequences, context tokens)``; no tensor is allocated.

    A chunk of one token on a request that already has KV is a decode (as in the model
    runner); every other chunk's tokens are prefill tokens. Context tokens are the tokens each
    scheduled sequence attends to (its KV length after the chunk).
    """

    def __init__(
        self, clock: VirtualClock, profile: CostProfile, token_id: int = DUMMY_TOKEN
    ) -> None:
        self.clock = clock
        self.profile = profile
        self.token_id = token_id
        self.last_iteration_s = 0.0
        self.busy_s = 0.0
        self.num_iterations = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    def execute(self, items: list[BatchItem]) -> dict[str, int]:
        prefill = decodes = context = 0
        sampled: dict[str, int] = {}
        token = self.token_id
        for item in items:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_tokens
            context += end
            if item.num_tokens == 1 and start > 0:
                decodes += 1
            else:
                prefill += item.num_tokens
            if end == request.num_tokens:
                sampled[request.request_id] = token
        seconds = iteration_time_s(self.profile, prefill, decodes, context)
        self.clock.now += seconds
        self.last_iteration_s = seconds
        self.busy_s += seconds
        self.num_iterations += 1
        self.num_prefill_tokens += prefill
        self.num_decode_tokens += decodes
        return sampled
