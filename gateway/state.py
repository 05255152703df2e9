"""Everything one gateway holds while it runs, built from settings and closed cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import structlog
from redis.asyncio import BlockingConnectionPool, Redis

from gateway.auth import ApiKeyCache, stored_key_ids
from gateway.auth_failures import AuthFailures, FailureRule
from gateway.chat import ChatRenderer
from gateway.dispatcher import Dispatcher
from gateway.generation_service import GenerationService
from gateway.heartbeat import Heartbeat
from gateway.inflight import InFlightRequests
from gateway.metrics import GatewayMetrics
from gateway.prompts import PromptEncoder
from gateway.response_store import ResponseStore
from gateway.settings import GatewaySettings
from gateway.workers import WorkerDirectory
from shared.model_source import model_display_name, resolve_model
from shared.runtime import loop_with_backoff
from shared.slo import default_class
from shared.tokenizer import load_tokenizer_bundle

log = structlog.get_logger(__name__)


class GatewayState:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.gateway_id = settings.gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        model_path = resolve_model(settings.model, settings.revision)
        bundle = load_tokenizer_bundle(model_path, settings.tokenizer)
        self.tokenizer = bundle.tokenizer
        self.chat = ChatRenderer(bundle, settings.chat_template)
        self.prompts = PromptEncoder(
            self.tokenizer, self.chat, settings.max_prompt_chars, settings.tokenizer_threads
        )
        self.model_name = settings.served_model_name or model_display_name(settings.model)
        pool = BlockingConnectionPool.from_url(
            settings.redis_url,
            max_connections=settings.redis_max_connections,
            timeout=settings.redis_timeout_s,  # waiting for a free connection
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
        )
        self.redis = Redis.from_pool(pool)  # closing the client closes the pool
        self.directory = WorkerDirectory(self.redis, settings)
        self.api_keys = ApiKeyCache(
            self.redis,
            miss_ttl_s=settings.api_key_miss_ttl_s,
            max_misses=settings.max_cached_api_key_misses,
        )
        self.dispatcher = Dispatcher(
            self.redis,
            self.gateway_id,
            settings.output_block_ms,
            InFlightRequests(),
            retry_after_s=settings.retry_after_s,
        )
        self.metrics = GatewayMetrics(
            self.directory, self.model_name, settings.vllm_metrics, settings.vllm_engine_metrics
        )
        self.generations = GenerationService(
            settings, self.redis, self.tokenizer, self.dispatcher, self.directory, self.metrics
        )
        rule = FailureRule(
            free=settings.auth_failures_free,
            window_s=settings.auth_failure_window_s,
            max_delay_s=settings.auth_failure_max_delay_s,
        )
        self.auth_failures = AuthFailures(self.metrics.auth_failures, rule)
        self.responses = ResponseStore(self.redis, settings.responses_ttl_s, settings.retry_after_s)
        # structured outputs are checked to compile here (gateway/sampling.py), one at a time
        self.grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-check")
        self.heartbeat = Heartbeat(
            settings.redis_url,
            self.gateway_id,
            settings.directory_refresh_s,
            settings.redis_timeout_s,
        )
        self.started_s = time.time()
        self._stop = asyncio.Event()
        self._refresher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        with contextlib.suppress(Exception):  # readiness reports it if Redis is away
            await self.directory.refresh()
            await self.api_keys.refresh()
            if self.settings.gateway_id is not None:  # a fixed id: it may have run before
                await self.dispatcher.abort_previous_incarnation(self.directory.statuses)
        self.heartbeat.start()  # a thread: a busy event loop cannot starve it
        self._refresher = asyncio.create_task(loop_with_backoff(self._refresh, self._stop))
        self.dispatcher.start()
        log.info("gateway_started", gateway_id=self.gateway_id, model=self.model_name)
        for warning in self.readiness()[1]:  # e.g. a default SLO class that is not one
            log.warning("gateway_start_warning", warning=warning)

    async def _refresh(self) -> None:
        await self.directory.refresh()  # first: it records whether Redis answers
        if await self.api_keys.refresh() and self.generations.has_keyed_requests():
            self.generations.end_revoked(await stored_key_ids(self.redis))
        await self.generations.check_workers()
        await asyncio.sleep(self.settings.directory_refresh_s)

    async def close(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self.heartbeat.stop)
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        await self.generations.drain()
        await self.dispatcher.close()
        await self.redis.aclose()
        self.prompts.close()
        self.grammar_thread.shutdown(wait=False, cancel_futures=True)
        log.info("gateway_stopped", gateway_id=self.gateway_id)

    def readiness(self) -> tuple[list[str], list[str]]:
        """(problems, warnings): ready means "can reach the system" (Redis reachable, a live
        worker), so only problems fail it. A live worker that drains counts: while the only
        worker rolls, requests get 503 ``no_worker`` with Retry-After from a ready gateway
        rather than refused connections from none. A control plane not seen is a warning: the
        workers plan locally meanwhile, and a gateway leaving its Service would stop traffic
        they serve."""
        problems = []
        if not self.directory.redis_ok:
            problems.append("redis unreachable")
        if not self.directory.alive():
            problems.append("no live data-plane worker")
        warnings = []
        if self.directory.redis_ok and not self.directory.control_plane_alive:
            warnings.append("control plane not seen recently; workers plan locally")
        classes, default = self.directory.slo_classes, self.settings.default_slo_class
        if default not in classes:  # a typo, or removed with force: served, in the loosest
            loosest = default_class(classes, default).name
            warnings.append(
                f"default_slo_class {default!r} is not an SLO class ({', '.join(sorted(classes))}):"
                f" requests without one are served in {loosest!r}, the loosest"
            )
        return problems, warnings
