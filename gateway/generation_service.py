"""The gateway's generations: route and submit each request (:meth:`GenerationService.start`),
keep its metrics and lifecycle record when it ends, move or fail the requests of workers that
died, restarted or drain, and abort what clients left."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.dispatcher import Dispatcher
from gateway.errors import APIError, bus_error
from gateway.generation import Generation, GenerationParams
from gateway.inflight import InFlight, InFlightRequests, Route
from gateway.limits import KeyLimiter
from gateway.metrics import GatewayMetrics
from gateway.placement import Placement
from gateway.settings import GatewaySettings
from gateway.workers import WorkerDirectory
from shared.protocol import SubmitRequest
from shared.tokenizer import Tokenizer

log = structlog.get_logger(__name__)


class GenerationService:
    def __init__(
        self,
        settings: GatewaySettings,
        redis: Redis,
        tokenizer: Tokenizer,
        dispatcher: Dispatcher,
        directory: WorkerDirectory,
        metrics: GatewayMetrics,
    ) -> None:
        """``dispatcher`` routes outputs into this service's in-flight records
        (``dispatcher.live``, the one index of live requests)."""
        self.settings = settings
        self.redis = redis
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.directory = directory
        self.metrics = metrics
        self._background: set[asyncio.Task[None]] = set()
        self.live: InFlightRequests = dispatcher.live
        self.key_limiter = KeyLimiter(
            settings.max_concurrent_per_key, settings.max_requests_per_s_per_key
        )

    async def start(
        self, request_id: str, params: GenerationParams, worker_id: str | None = None
    ) -> Generation:
        """Route (to ``worker_id`` when it can take it: a sibling of ``n`` choices, for its
        prefix cache) and submit; 503/429 when no worker can take it."""
        num_prompt_tokens = len(params.prompt_token_ids)
        status = self.directory.choose(num_prompt_tokens, prefer=worker_id)
        ahead = self.directory.queued_prefill_tokens(status) + num_prompt_tokens
        placement = Placement(  # before any await; 429 when over the key's limits
            self.directory, self.key_limiter, status.worker_id, num_prompt_tokens, params.key_id
        )
        route = Route(status.worker_id, status.epoch, request_id)
        max_buffered = self.settings.max_buffered_outputs
        seen_s = time.monotonic() - self.directory.beat_age_s(status)
        record = InFlight(request_id, route, placement, max_buffered, seen_s)
        generation = Generation(self, record, params, ahead)
        submit = SubmitRequest(
            request_id=request_id,
            prompt_token_ids=params.prompt_token_ids,
            reply_stream=self.dispatcher.reply_stream,
            t_arr_s=generation.timeline.t_arr_s,
            sampling=replace(params.sampling, stop=()),
            priority=params.priority,
            slo_class=params.slo.name,
            slo_ttft_s=params.slo.ttft_s,
            slo_tbt_s=params.slo.tbt_s,
            tenant=params.tenant,
        )
        record.submit = submit  # kept until the first token, to move it if its worker dies
        self.live.add(record)  # before the submit: its first output must find it
        try:
            await self.dispatcher.submit(record, submit)
        except RedisError as exc:
            self.live.release(record)
            message = f"could not reach the request bus: {exc}"
            raise bus_error(message, self.settings.retry_after_s) from exc
        log.info("request_submitted", request_id=request_id, worker_id=status.worker_id)
        return generation

    def observe_tokens(
        self, generation: Generation, num_tokens: int, gaps_s: list[float], first: bool
    ) -> None:
        """An output's tokens into the metrics as they arrive (with the first: TTFT, prompt)."""
        timeline = generation.timeline
        ttft_s = None
        if first and timeline.t_first_s is not None:
            ttft_s = timeline.t_first_s - timeline.t_arr_s
        num_prompt_tokens = generation.num_prompt_tokens if first else 0
        slo_class = generation.params.slo.name
        self.metrics.observe_tokens(slo_class, num_tokens, gaps_s, ttft_s, num_prompt_tokens)

    def finish(self, generation: Generation) -> None:
        """Bookkeeping when a generation ends for any reason (finished, error, disconnect)."""
        record, timeline = generation.record, generation.timeline
        if not self.live.release(record):
            return
        reason = generation.finish_reason
        if reason is None:  # the client went away, or an error: free the worker's blocks
            self.abort_later(record.route)
            reason = "error" if generation.failed else "abort"
        now = time.time()
        slo = generation.params.slo
        self.metrics.observe_finished(
            slo.name,
            reason,
            None if timeline.t_first_s is None else timeline.t_first_s - timeline.t_arr_s,
            timeline.gaps_s,
            now - timeline.t_arr_s,
            None if timeline.t_first_run_s is None else timeline.t_first_run_s - timeline.t_arr_s,
            generation.num_prompt_tokens,
            slo.ttft_s,
            slo.tbt_s,
            generation.params.tenant,
            num_output_tokens=generation.num_completion_tokens,
        )
        fields: dict[str, str | float | int] = {"gateway_finished_s": now, "gateway_finish": reason}
        fields["gateway_id"] = self.dispatcher.gateway_id
        fields["priority"] = generation.params.priority  # as served (a key's floor applied)
        if generation.params.tenant is not None:
            fields["tenant"] = generation.params.tenant
        if generation.params.end_user is not None:  # for abuse monitoring, as OpenAI's
            fields["user"] = generation.params.end_user
        if timeline.t_first_s is not None:
            fields["first_token_s"] = timeline.t_first_s
        self._record(generation.request_id, **fields)
        log.info("request_finished", request_id=generation.request_id, finish_reason=reason)

    def has_keyed_requests(self) -> bool:
        return any(record.placement.key_id is not None for record in self.live)

    def end_revoked(self, stored_key_ids: set[str]) -> None:
        """End every live request whose API key is no longer stored (deleted by the admin
        API, on any gateway) with a 401; its generation's end aborts it on its worker (a
        revoked key's streams kept generating to max_tokens)."""
        for record in self.live:
            key_id = record.placement.key_id
            if key_id is not None and key_id not in stored_key_ids and not record.released:
                log.warning("request_key_revoked", request_id=record.request_id, key_id=key_id)
                message = "the API key of this request was deleted"
                record.outputs.end(APIError(401, message, code="key_revoked"))

    async def check_workers(self) -> None:
        """Requests on a worker that stopped beating (or restarted) do not hang: those with no
        token yet go to another worker (a restarted one's new incarnation too), the others end
        with a clear error. Those with no token on a draining worker move at once when another
        worker takes requests, and those on one that left cleanly (drained: its status
        deleted) once it has been silent for ``worker_dead_s``; with none they wait (it serves
        what it admitted; its next incarnation reads the rest, left pending in its stream),
        within their first-token deadline."""
        now = time.monotonic()
        dead_s = self.settings.worker_dead_s
        for record in self.live:
            if record.released:  # finished while an earlier request was being moved
                continue
            route = record.route
            status = self.directory.statuses.get(route.worker_id)
            if status is not None and status.epoch == route.epoch:
                seen_s = now - self.directory.beat_age_s(status)
                record.t_route_seen_s = max(record.t_route_seen_s, seen_s)
            restarted = status is not None and status.epoch != route.epoch
            dead = now - record.t_route_seen_s > dead_s
            draining = status is not None and not (restarted or dead or status.accepting)
            left = status is None  # its status deleted: it exited (drained)
            if not (restarted or dead or draining):
                continue
            waiting = record.submit if record.num_received == 0 else None  # no token yet
            if waiting is not None:
                try:
                    if await self._resubmit(record, waiting):
                        continue
                except RedisError as exc:
                    log.error("resubmit_failed", request_id=record.request_id, error=str(exc))
            if draining or (left and waiting is not None):
                continue
            reason = "restarted" if restarted else f"sent no heartbeat for {dead_s:g} s"
            message = f"worker {route.worker_id} {reason}; the request was lost"
            log.error("request_lost_with_worker", request_id=record.request_id, reason=reason)
            record.outputs.end(APIError(503, message, code="worker_lost"))

    async def _resubmit(self, record: InFlight, submit: SubmitRequest) -> bool:
        old = record.route
        candidates = [
            s
            for s in self.directory.routable()
            if (s.worker_id, s.epoch) != (old.worker_id, old.epoch)
        ]
        if not candidates:
            return False
        status = self.directory.least_loaded(candidates)
        route = old.next(status.worker_id, status.epoch, record.request_id)
        record.t_route_seen_s = time.monotonic() - self.directory.beat_age_s(status)
        await self.dispatcher.move(record, submit, route)
        if record.released:  # the client left while it moved: drop the new copy too
            self.abort_later(route)
            return True
        log.warning("request_moved", request_id=record.request_id, worker_id=status.worker_id)
        return True

    def abort_later(self, route: Route) -> None:
        """Tell ``route``'s worker to drop it, now; if Redis refuses, after the dispatcher's
        next good read (a lost abort left the worker serving a client gone)."""
        self._spawn(self._abort(route))

    async def _abort(self, route: Route) -> None:
        try:
            await self.dispatcher.abort(route)
        except RedisError:
            self.dispatcher.abort_after_next_read(route)
            raise

    def _record(self, request_id: str, **fields: str | float | int) -> None:
        self._spawn(self.dispatcher.record(request_id, fields))

    def _spawn(self, work: object) -> None:
        async def guarded() -> None:
            try:
                await work  # type: ignore[misc]
            except RedisError as exc:
                log.warning("background_redis_error", error=str(exc))

        task = asyncio.get_running_loop().create_task(guarded())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
