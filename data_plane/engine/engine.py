"""The engine loop: ask the policy for a plan, execute it, sample, stream outputs.

The engine is mechanism only. Every iteration it builds a :class:`Snapshot`, asks its planner
(a pure function from ``shared.policy``, or a plan received from the control plane) what to do,
applies the plan's state changes, allocates blocks, runs the executor and processes tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from data_plane.engine.executor import BatchItem, Executor, Sampled
from data_plane.engine.output import check_stop
from data_plane.engine.request import (
    FINISHED_STATUS,
    TRANSITIONS,
    FinishReason,
    Request,
    RequestError,
    RequestOutput,
    RequestStatus,
)
from data_plane.engine.sampling import SamplingParams
from data_plane.engine.servable import check_servable
from data_plane.engine.tenants import TenantLedger
from data_plane.engine.views import PolicyViews
from data_plane.kv.manager import KVEventKind
from shared.policy import (
    ColumnarSnapshot,
    Plan,
    RequestColumns,
    RequestState,
    Snapshot,
)
from shared.sampling import StructuredOutput
from shared.tokenizer import Tokenizer

if TYPE_CHECKING:  # the KV layer holds torch tensors; the loop itself needs no torch
    from data_plane.engine.structured import Grammars
    from data_plane.kv.manager import KVEvent
    from data_plane.kv.tiered import KVCacheManager

Planner = Callable[[Snapshot | ColumnarSnapshot], Plan]


@dataclass(slots=True)
class EngineStats:
    num_iterations: int = 0
    num_preemptions: int = 0
    num_rotations_out: int = 0
    num_rotations_in: int = 0
    # plan chunks that found no blocks: 0 without prefix caching; with it a prefix taken this
    # step holds evictable blocks the plan counted free (an admitted one goes back to waiting)
    num_skipped_chunks: int = 0
    num_generated_tokens: int = 0
    model_time_s: float = 0.0
    step_time_s: float = 0.0
    last_plan: Plan = field(default_factory=Plan)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one iteration produced: the outputs to stream and the snapshot its plan was made
    from, with its requests as columns when the engine keeps them (``keep_columns``: the
    worker publishes those to the control plane)."""

    outputs: list[RequestOutput]
    snapshot: Snapshot | ColumnarSnapshot
    columns: RequestColumns | None = None


class Engine:
    def __init__(
        self,
        executor: Executor,
        kv: KVCacheManager,
        planner: Planner,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer: Tokenizer | None = None,
        clock: Callable[[], float] = time.monotonic,
        vocab_size: int | None = None,
        columnar: bool = False,
        keep_columns: bool = False,
        grammars: Grammars | None = None,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        """``columnar``: give the planner :class:`ColumnarSnapshot` (for the columnar LVF)
        instead of views. ``keep_columns``: return each iteration's snapshot as columns too
        (:attr:`StepResult.columns`, the worker's wire snapshot). ``grammars``: compiles
        requests' structured outputs (without it, a request asking for one is refused)."""
        self.executor = executor
        self.kv = kv
        self.planner = planner
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.long_prefill_token_threshold = long_prefill_token_threshold  # vLLM's: 0 is none
        # a request's KV must fit the HBM pool to run at all: one that grew past it could
        # never come back from DRAM (and, rotary at the head of L, would hold the room forever)
        self.max_model_len = min(max_model_len, kv.num_hbm_blocks * kv.block_size + 1)
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.clock = clock
        self.vocab_size = vocab_size
        self.columnar = columnar
        self.keep_columns = keep_columns
        self.grammars = grammars
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.views = PolicyViews(kv)
        self.waiting = self.views.waiting  # the engine moves requests in and out of these
        self.rotary = self.views.rotary
        self.stats = EngineStats()
        self.tenants = TenantLedger()  # each tenant's recent service: this engine counts it
        self._arrival_seq = 0
        self._pending_outputs: list[RequestOutput] = []

    # ---- requests in and out -------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        slo_ttft_s: float | None = None,
        slo_tbt_s: float | None = None,
        t_arr_s: float | None = None,
        tenant: str | None = None,
    ) -> Request:
        """Queue a request; raises :class:`RequestError` if it can never be served.
        ``tenant``: who it is served for (the policy's per-tenant fairness)."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in the engine")
        check_servable(prompt_token_ids, params, self.kv, self.max_model_len, self.vocab_size)
        self._arrival_seq += 1
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            t_arr_s=self.clock() if t_arr_s is None else t_arr_s,
            arrival_seq=self._arrival_seq,
            priority=priority,
            slo_ttft_s=slo_ttft_s,
            slo_tbt_s=slo_tbt_s,
        )
        if params.structured is not None:
            if self.grammars is None:
                raise RequestError("this engine serves no structured outputs")
            request.grammar = self.grammars.matcher(params.structured)
        # last: a request refused above must not count as one of its tenant's live requests
        request.tenant = self.tenants.enter(tenant, request.t_arr_s)
        if request.reads_prefix_cache:
            request.block_keys = self.kv.prefix_keys(request.prompt_token_ids)
        # masked until min_tokens: EOS too under ignore_eos (vLLM's rule)
        request.stop_ids = tuple(dict.fromkeys((*self.eos_token_ids, *params.stop_token_ids)))
        self.requests[request_id] = request
        self.waiting.append(request)
        return request

    def grammar_ready(self, structured: StructuredOutput) -> bool:
        """Whether :meth:`add_request` finds ``structured`` compiled (or refuses it at once:
        an engine without grammars); else :meth:`compile_grammar` first, off the loop."""
        return self.grammars is None or self.grammars.is_compiled(structured)

    def compile_grammar(self, structured: StructuredOutput) -> None:
        """Compile ``structured`` for this vocabulary (any thread; RequestError when it does
        not compile)."""
        if self.grammars is not None:
            self.grammars.compile(structured)

    def abort(self, request_id: str) -> bool:
        """Abort at any time; frees the request's blocks in every tier."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        self._finish(request, FinishReason.ABORT)
        self._pending_outputs.append(
            RequestOutput(request_id, [], len(request.output_token_ids), FinishReason.ABORT)
        )
        return True

    def close(self) -> None:
        """Drain and release the KV tiers (copies, streams, pinned memory)."""
        self.kv.close()

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.rotary or self._pending_outputs)

    # ---- one iteration -------------------------------------------------------------------
    def step(self) -> StepResult:
        t_start = time.perf_counter()
        self.stats.num_iterations += 1
        events = self.kv.poll()
        self.views.refresh_waiting()
        now = self.clock()
        if events:
            self._on_kv_events(events, now)
        counts = self._snapshot_counts(now)
        snapshot, columns = self.views.planner_input(
            now, self.running, counts, self.columnar, self.keep_columns
        )
        plan = self.planner(snapshot)
        self.stats.last_plan = plan
        self._apply_transitions(plan, now)
        items = self._allocate(plan, now)
        self.kv.issue_transfers()
        outputs, self._pending_outputs = self._pending_outputs, []
        if items:
            t_model = time.perf_counter()
            sampled = self.executor.execute(items)
            self.stats.model_time_s += time.perf_counter() - t_model
            self.kv.after_compute()
            outputs.extend(self._process(items, sampled, self.clock()))
        else:
            self.kv.wait_for_progress()  # nothing to compute: only a copy can unblock us
        self.stats.step_time_s += time.perf_counter() - t_start
        return StepResult(outputs, snapshot, columns)

    def snapshot(self, now: float) -> Snapshot:
        """The engine for the policy: running, then waiting, then rotary requests."""
        return self.views.snapshot(now, self.running, self._snapshot_counts(now))

    def columnar_snapshot(self, now: float) -> ColumnarSnapshot:
        """:meth:`snapshot` as columns (the waiting requests' come ready-made)."""
        return self.views.columnar_snapshot(now, self.running, self._snapshot_counts(now))

    def _snapshot_counts(self, now: float) -> dict[str, Any]:
        return {
            "tenant_service": self.tenants.service(now),
            "num_free_hbm_blocks": self.kv.num_free_hbm_blocks,
            "num_free_dram_blocks": self.kv.num_free_dram_blocks,
            "block_size": self.kv.block_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
            "b_xfer_blocks": self.kv.b_xfer_available,
            "iteration": self.stats.num_iterations,
        }

    def _move(self, request: Request, status: RequestStatus) -> None:
        """The one place a request's status changes (``TRANSITIONS`` says which moves are
        legal; anything else is a bug, raised)."""
        if status not in TRANSITIONS.get(request.status, ()):
            raise RuntimeError(
                f"request {request.request_id!r} cannot move {request.status.name} -> {status.name}"
            )
        request.status = status

    def _on_kv_events(self, events: list[KVEvent], now: float) -> None:
        """Copies that completed: a loading request is resident (and runs from now: t_run is
        when it can compute again, not when its copy was issued, SUPERINFER.md §3); a
        rotating-out one is parked (it may rotate in again)."""
        for request_id, kind in events:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if kind is KVEventKind.LOADED and request.status is RequestStatus.LOADING:
                self._move(request, RequestStatus.RUNNING)
                request.t_run_s = now
            elif kind is KVEventKind.PARKED and request.status is RequestStatus.ROTATING_OUT:
                self._move(request, RequestStatus.ROTARY)

    def _apply_transitions(self, plan: Plan, now: float) -> None:
        # in the plan's order (the newest first), each to the front: the oldest victim ends
        # first in line, as vLLM V1's prepend of each victim it pops
        for request_id in plan.preempt_ids:
            self._preempt(self._expect(request_id, RequestState.RUNNING))
        for request_id in plan.rotate_out_ids:
            request = self._expect(request_id, RequestState.RUNNING)
            num_copying = self.kv.rotate_out(request_id)
            if num_copying is None:  # no room in DRAM, or still loading: recompute instead
                self._preempt(request)
                continue
            self.running.remove(request)
            parked = RequestStatus.ROTATING_OUT if num_copying else RequestStatus.ROTARY
            self._move(request, parked)
            request.num_rotations += 1
            self.stats.num_rotations_out += 1
            self.rotary.append(request)
        for request_id in plan.resume_ids:
            self._resume(self._expect(request_id, RequestState.ROTARY), now)
        for request_id in plan.admit_ids:
            request = self._expect(request_id, RequestState.WAITING)
            self.views.leave_waiting(request)
            # every prompt is a prefix-cache query (vLLM's count), one shorter than a block too
            reads_cache = self.kv.prefix_caching and request.reads_prefix_cache
            loading = self._take_prefix(request) if reads_cache else False
            self._move(request, RequestStatus.LOADING if loading else RequestStatus.RUNNING)
            request.t_run_s = now
            request.t_first_run_s = request.t_first_run_s or now
            self.running.append(request)

    def _resume(self, request: Request, now: float) -> None:
        """Rotate in, unless its copies out are in flight or HBM is short (the policy will
        ask again)."""
        if request.status is RequestStatus.ROTATING_OUT:
            return
        num_loading = self.kv.rotate_in(request.request_id)
        if num_loading is None:
            return
        self.rotary.remove(request)
        self._move(request, RequestStatus.LOADING if num_loading else RequestStatus.RUNNING)
        request.t_run_s = now  # set again when its KV is resident (_on_kv_events)
        self.stats.num_rotations_in += 1
        self.running.append(request)

    def _take_prefix(self, request: Request) -> bool:
        """An admitted request shares its cached prefix: those tokens need no prefill (a
        prefix found in DRAM is copied in first). Returns whether it is loading."""
        taken = self.kv.take_prefix(request.request_id, request.all_token_ids, request.block_keys)
        request.num_computed_tokens = taken.num_blocks * self.kv.block_size
        request.num_cached_tokens = request.num_computed_tokens
        return taken.num_loading > 0

    def _unadmit(self, request: Request, now: float) -> None:
        """An admitted request whose first chunk found no free block goes back to waiting
        (it holds no KV): running means "KV in HBM, scheduled"."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0  # a cached prefix it took is given back
        self._move(request, RequestStatus.WAITING)
        request.t_run_s = None
        if request.t_first_run_s == now:
            request.t_first_run_s = None
        self.waiting.appendleft(request)

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop the KV, back to the front of the waiting queue."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        self._move(request, RequestStatus.WAITING)
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _expect(self, request_id: str, state: RequestState) -> Request:
        request = self.requests.get(request_id)
        if request is None or request.finished or request.state is not state:
            raise RuntimeError(f"plan names {request_id!r}, which is not {state.value}")
        return request

    def _allocate(self, plan: Plan, now: float) -> list[BatchItem]:
        items: list[BatchItem] = []
        admitted = set(plan.admit_ids)
        for chunk in plan.schedule:
            request = self._expect(chunk.request_id, RequestState.RUNNING)
            end = request.num_computed_tokens + chunk.num_tokens
            if chunk.request_id in admitted and request.block_keys:  # its prefix came cached
                if not request.resident:
                    continue  # its DRAM prefix is still being copied in
                end = min(end, request.num_tokens)
            if end > request.num_tokens or not request.resident:
                raise RuntimeError(f"plan schedules {chunk} beyond {request.request_id}'s state")
            block_ids = self.kv.ensure_hbm(chunk.request_id, request.num_computed_tokens, end)
            if block_ids is None:
                self.stats.num_skipped_chunks += 1
                if chunk.request_id in admitted:  # nothing computed yet: back to waiting
                    self._unadmit(request, now)
                continue
            items.append(BatchItem(request, end - request.num_computed_tokens, block_ids))
        return items

    def _process(self, items: list[BatchItem], sampled: Sampled, now: float) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for item in items:
            request = item.request
            before = request.num_computed_tokens
            request.num_computed_tokens += item.num_tokens
            self.tenants.charge(request.tenant, item.num_tokens, now)
            self._on_computed(request, before)
            prompt_part = sampled.prompt_logprobs.get(request.request_id)
            if prompt_part is not None:
                request.record_prompt_logprobs(*prompt_part)
            token = sampled.token_ids.get(request.request_id)
            if token is None or request.finished:
                continue
            request.output_token_ids.append(token)
            request.t_first_token_s = request.t_first_token_s or now
            request.t_last_s = now
            self.stats.num_generated_tokens += 1
            reason, delta = check_stop(
                request, token, self.eos_token_ids, self.max_model_len, self.tokenizer
            )
            if request.grammar is not None:
                request.grammar.accept_token(token)  # the mask allowed only what it accepts
                if reason is None and request.grammar.is_terminated():
                    reason = FinishReason.STOP  # the grammar is complete
            if reason is not None:
                self._finish(request, reason)
            logprobs = sampled.logprobs.get(request.request_id)
            outputs.append(request.output(token, reason, delta, logprobs))
        return outputs

    def _on_computed(self, request: Request, num_before: int) -> None:
        """Tell the KV manager what was computed; with prefix caching, blocks that filled in
        this step get their keys and join the index."""
        bs, num_computed = self.kv.block_size, request.num_computed_tokens
        if not self.kv.prefix_caching or num_computed // bs == num_before // bs:
            self.kv.on_computed(request.request_id, num_computed)
            return
        tokens, keys = request.all_token_ids, request.block_keys
        self.kv.extend_prefix_keys(keys, tokens, num_computed)  # generated tokens filled one
        self.kv.on_computed(request.request_id, num_computed, tokens, keys)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        state = request.state
        self._move(request, FINISHED_STATUS[reason])
        if state is RequestState.WAITING:
            self.views.leave_waiting(request)
        else:  # identity comparison: requests compare by id (eq=False)
            (self.running if state is RequestState.RUNNING else self.rotary).remove(request)
        self.kv.free(request.request_id)
        self.tenants.leave(request.tenant)
        del self.requests[request.request_id]
