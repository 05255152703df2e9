"""One submitted request in the gateway (:class:`Generation`, made by
:class:`gateway.generation_service.GenerationService`): the worker's token messages turned into
text deltas, with stop strings, first-token and between-token deadlines and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from gateway.errors import APIError
from gateway.inflight import InFlight, Route
from gateway.settings import GatewaySettings
from gateway.workers import WorkerDirectory
from shared.detokenizer import IncrementalDetokenizer
from shared.logprobs import TokenLogprobs
from shared.protocol import TokenOutput
from shared.sampling import SamplingParams
from shared.slo import SloClass
from shared.tokenizer import Tokenizer

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class GenerationParams:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    slo: SloClass
    priority: int = 0
    tenant: str | None = None
    key_id: str | None = None  # the API key's id, for its limits
    end_user: str | None = None  # OpenAI's ``user``: kept in the request's lifecycle record
    prompt_param: str = "prompt"  # the body's field the prompt came from (chat: messages)
    # when the client's request arrived (None: now); n > 1 siblings share their first's
    t_arr_s: float | None = None


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    num_tokens: int  # tokens this delta covers
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()
    logprobs: TokenLogprobs | None = None  # of token_ids, when the request asked


KEEPALIVE = Delta("", 0)  # what :meth:`Generation.deltas` yields while it waits, to keep alive


@dataclass(slots=True)
class _Timeline:
    t_arr_s: float
    t_first_s: float | None = None
    t_prev_s: float | None = None
    t_first_run_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)

    def on_tokens(self, num_tokens: int, now: float) -> list[float]:
        """Note an output of ``num_tokens`` arriving at ``now``; returns the inter-token gaps
        it closes (a first output's tokens after the first: no measured gap, none)."""
        if num_tokens <= 0:
            return []
        gaps_s: list[float] = []
        if self.t_first_s is None:
            self.t_first_s = now
        elif self.t_prev_s is not None:
            gaps_s = [(now - self.t_prev_s) / num_tokens] * num_tokens
            self.gaps_s.extend(gaps_s)
        self.t_prev_s = now
        return gaps_s


class GenerationHost(Protocol):
    """What a generation asks of the service that made it
    (:class:`gateway.generation_service.GenerationService`)."""

    settings: GatewaySettings
    directory: WorkerDirectory
    tokenizer: Tokenizer

    def finish(self, generation: Generation) -> None: ...

    def observe_tokens(
        self, generation: Generation, num_tokens: int, gaps_s: list[float], first: bool
    ) -> None: ...

    def abort_later(self, route: Route) -> None: ...


class Generation:
    """A submitted request; iterate :meth:`deltas` once. Its usage counts are final after."""

    def __init__(
        self,
        service: GenerationHost,
        record: InFlight,
        params: GenerationParams,
        num_tokens_ahead: int = 0,
    ) -> None:
        """``record``: the request in flight (route, placement, outputs; the service's);
        ``num_tokens_ahead``: prompt tokens its worker prefills before its first token, its
        own included (the first-token deadline allows their predicted time)."""
        self.service = service
        self.record = record
        self.params = params
        self.request_id = record.request_id
        self.num_prompt_tokens = len(params.prompt_token_ids)
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the worker's prefix cache served
        self.finish_reason: str | None = None
        # vLLM's stop_reason: the stop string or stop token id that ended it (None: EOS,
        # a length, or not ended yet)
        self.stop_reason: str | int | None = None
        self._timeline = _Timeline(time.time() if params.t_arr_s is None else params.t_arr_s)
        self.failed = False  # the worker refused or failed it (finished_reason "error")
        sampling = params.sampling
        self._detok = IncrementalDetokenizer(
            service.tokenizer,
            params.prompt_token_ids,
            list(sampling.stop),
            min_tokens=sampling.min_tokens,
            include_stop_str=sampling.include_stop_str_in_output,
        )
        # the prompt tokens' log-probabilities (from the second on), when asked: they come
        # with the first token
        self.prompt_logprobs: TokenLogprobs | None = None
        self._wait_deadline: float | None = None  # monotonic time the current wait times out at
        self._t_admitted = time.monotonic()
        self._num_tokens_ahead = num_tokens_ahead
        self._first_token_allowed_s = 0.0  # the largest allowance so far: it never shrinks

    async def wait_first_output(self) -> None:
        """Until the worker's first output (or the first-token deadline, or the request's
        end): the prompt is then computed, and in the worker's prefix cache."""
        with contextlib.suppress(TimeoutError):
            deadline, _ = self._deadline(time.monotonic())
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await self.record.outputs.wait()

    async def deltas(self, keepalive_s: float | None = None) -> AsyncIterator[Delta]:
        """Text deltas until the finish reason; raises APIError on a worker error or timeout.
        With ``keepalive_s``, :data:`KEEPALIVE` whenever that long passed without an output
        (the token timeout still counts from the start of the wait). Leaving early (a client
        disconnect) aborts the request on its worker."""
        try:
            while self.finish_reason is None:
                msg = await self._next_output(keepalive_s)
                if msg is None:
                    yield KEEPALIVE
                    continue
                delta = self._apply(msg)
                if delta.text or delta.finish_reason or delta.num_tokens:
                    yield delta
        finally:
            self.service.finish(self)

    async def _next_output(self, keepalive_s: float | None) -> TokenOutput | None:
        """The next output (None: a keep-alive is due); raises the request's outcome once it
        failed (worker lost, client too slow, output lost) or the worker's error."""
        msg = self.record.outputs.get_nowait()  # no timer when an output is already waiting
        if msg is None:
            msg = await self._wait_output(keepalive_s)
            if msg is None:
                return None
        self._wait_deadline = None
        if msg.error:  # a rejected request (400) or the worker's own failure (500)
            self.failed = True
            if msg.error_kind == "orphaned":  # this gateway was frozen past gateway_dead_s
                retry = {"Retry-After": str(self.service.settings.retry_after_s)}
                raise APIError(503, msg.error, code="gateway_stalled", headers=retry)
            failed = msg.index > 0 or msg.error_kind == "engine"
            param = msg.error_param
            if param == "prompt":
                param = self.params.prompt_param
            raise APIError(500 if failed else 400, msg.error, param=param, code="worker_error")
        return msg

    async def _wait_output(self, keepalive_s: float | None) -> TokenOutput | None:
        """The next output, or None when ``keepalive_s`` passed first (one timer either way);
        504 once :meth:`_deadline` passed."""
        while True:
            now = time.monotonic()
            deadline, message = self._deadline(now)
            left_s = deadline - now
            if left_s <= 0:
                raise APIError(504, message, code="worker_timeout")
            keepalive = keepalive_s is not None and 0 < keepalive_s < left_s
            try:
                async with asyncio.timeout(keepalive_s if keepalive else left_s):
                    return await self.record.outputs.get()
            except TimeoutError:
                if keepalive:
                    return None
            # The deadline passed, or moved (a first token's, from a newly measured rate).

    def _deadline(self, now: float) -> tuple[float, str]:
        """When the wait times out, and the error's message then. The first token:
        the floor plus the slack x the predicted prefill of the tokens ahead, from admission,
        at the worker's latest measured rate (a slower rate extends it, a faster one never
        shortens it); later outputs: token_timeout_s after the last."""
        settings = self.service.settings
        if self._timeline.t_first_s is not None:
            if self._wait_deadline is None:
                self._wait_deadline = now + settings.token_timeout_s
            return (
                self._wait_deadline,
                f"no output from the worker in {settings.token_timeout_s:g} s",
            )
        floor_s = settings.first_token_timeout_s
        allowed_s = settings.token_timeout_s if floor_s is None else floor_s
        if self._num_tokens_ahead > 0:
            worker_id = self.record.route.worker_id
            prefill_s = self.service.directory.prefill_s(worker_id, self._num_tokens_ahead)
            allowed_s += settings.first_token_slack * prefill_s
        allowed_s = self._first_token_allowed_s = max(self._first_token_allowed_s, allowed_s)
        message = f"no first token from the worker within {allowed_s:.3g} s of admission"
        return self._t_admitted + allowed_s, message

    def _apply(self, msg: TokenOutput) -> Delta:
        now = time.time()
        if msg.t_first_run_s is not None:
            self._timeline.t_first_run_s = msg.t_first_run_s
        if msg.token_ids and self._timeline.t_first_s is None:
            self.record.started()
        if msg.prompt_logprobs is not None:
            self.prompt_logprobs = msg.prompt_logprobs
        if msg.num_cached_tokens:
            self.num_cached_tokens = msg.num_cached_tokens
        first = self._timeline.t_first_s is None
        gaps_s = self._timeline.on_tokens(len(msg.token_ids), now)
        if msg.token_ids:
            self.service.observe_tokens(self, len(msg.token_ids), gaps_s, first)
        self.num_completion_tokens += len(msg.token_ids)
        reason = msg.finish_reason
        shown = msg.token_ids
        if reason == "stop" and shown:  # the worker stops on a stop token (EOS or asked for)
            if shown[-1] in self.params.sampling.stop_token_ids:
                self.stop_reason = shown[-1]
            if not self.params.sampling.include_stop_str_in_output:
                shown = shown[:-1]  # not in the text (vLLM's)
        text = self._detok.add(shown)
        if self._detok.stopped:  # a stop string ends it, even in the worker's last message
            if reason is None:
                self.service.abort_later(self.record.route)  # the worker need not go on
            reason = "stop"
            self.stop_reason = self._detok.stop_string
        if reason is not None:
            text += self._detok.flush()
            self.finish_reason = reason
        return Delta(text, len(msg.token_ids), reason, tuple(msg.token_ids), msg.logprobs)

    @property
    def timeline(self) -> _Timeline:
        return self._timeline
