"""An executor that runs no model: it charges the cost model's iteration time to the virtual
clock and samples a dummy token for every request whose chunk reached its last known token."""

from __future__ import annotations

from typing import Protocol

from data_plane.engine.executor import BatchItem, Executor, Sampled
from lab.costmodel import CostProfile, copy_interference_s, iteration_time_s
from lab.sim.clock import VirtualClock

DUMMY_TOKEN = 3


class LinkBusy(Protocol):
    """What the executor asks the transfer engine: seconds its link copies in [t0, t1]."""

    def busy_s_between(self, t0_s: float, t1_s: float) -> float: ...


class SimulatedExecutor(Executor):
    """``execute`` advances ``clock`` by ``iteration_time_s(profile, prefill tokens, decode
    sequences, context tokens, attention pairs)``, plus the copy/compute interference
    (``costmodel.copy_interference_s``) of the KV copies ``copies`` runs under that compute;
    no tensor is allocated.

    A chunk of one token on a request that already has KV is a decode (as in the model
    runner); every other chunk's tokens are prefill tokens, and its (query, key) pairs
    (``costmodel.prefill_attention_pairs``) are attention pairs. Context tokens are the tokens
    each scheduled sequence attends to (its KV length after the chunk).
    """

    def __init__(
        self,
        clock: VirtualClock,
        profile: CostProfile,
        token_id: int = DUMMY_TOKEN,
        copies: LinkBusy | None = None,
    ) -> None:
        self.clock = clock
        self.profile = profile
        self.token_id = token_id
        self.copies = copies  # the transfer engine, when KV copies can run under the compute
        self.last_iteration_s = 0.0
        self.busy_s = 0.0
        self.interference_s = 0.0  # of busy_s: the slowdown from copies running alongside
        self.num_iterations = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    def execute(self, items: list[BatchItem]) -> Sampled:
        prefill = decodes = context = pairs = 0
        sampled: dict[str, int] = {}
        token = self.token_id
        for item in items:
            request = item.request
            start = request.num_computed_tokens
            num = item.num_tokens
            end = start + num
            context += end
            if num == 1 and start > 0:
                decodes += 1
            else:
                prefill += num
                pairs += num * start + num * (num + 1) // 2  # prefill_attention_pairs
            if end == request.num_tokens:
                sampled[request.request_id] = token
        seconds = iteration_time_s(self.profile, prefill, decodes, context, pairs)
        if self.copies is not None and seconds > 0:
            now = self.clock.now
            extra = copy_interference_s(
                self.profile, seconds, self.copies.busy_s_between(now, now + seconds)
            )
            self.interference_s += extra
            seconds += extra
        self.clock.now += seconds
        self.last_iteration_s = seconds
        self.busy_s += seconds
        self.num_iterations += 1
        self.num_prefill_tokens += prefill
        self.num_decode_tokens += decodes
        return Sampled(sampled)
