"""Build and run the worker from settings."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Iterator

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis

from data_plane.engine.config import EngineConfig
from data_plane.engine.engine import Engine, Planner
from data_plane.engine.llm import Serving, build_engine, warm_up
from data_plane.models import load_model
from data_plane.planner import HybridPlanner
from data_plane.service import Worker
from data_plane.settings import WorkerSettings, missing_device_problem
from data_plane.threads import apply_thread_policy
from shared.errors import ConfigError
from shared.health import redis_reachable, serve_health
from shared.metrics_vllm import vllm_engine_families
from shared.model_source import resolve_model
from shared.policy import Knobs

log = structlog.get_logger(__name__)


def build_worker(settings: WorkerSettings, redis: Redis) -> Worker:
    """The worker for ``settings``: its planner, then its engine built once around it."""
    knobs = Knobs(policy=settings.policy, b_xfer=settings.b_xfer)
    planner = HybridPlanner(knobs, settings.plan_max_age_iterations, uuid.uuid4().hex[:12])
    engine, block_bytes = build_worker_engine(settings, planner)
    return Worker(settings, engine, planner, redis, block_bytes)


def build_worker_engine(settings: WorkerSettings, planner: Planner) -> tuple[Engine, int]:
    """The serving engine for ``settings`` around ``planner``, and its KV block in bytes."""
    model_path = resolve_model(settings.model, settings.revision)
    num_threads = apply_thread_policy(settings.threads)
    log.info(
        "loading_weights",
        model=settings.model,
        path=model_path,
        device=settings.device,
        threads=num_threads,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
    )
    t_start = time.perf_counter()
    loaded = load_model(
        model_path, settings.tokenizer, settings.dtype, settings.device, 0, settings.quantization
    )
    log.info("weights_loaded", seconds=round(time.perf_counter() - t_start, 2))
    config = EngineConfig(
        block_size=settings.block_size,
        num_hbm_blocks=settings.num_hbm_blocks,
        hbm_kv_gib=settings.hbm_kv_gib,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_model_len=settings.max_model_len,
        num_dram_blocks=settings.num_dram_blocks,
        dram_kv_gib=host_tier_gib(settings),
        max_num_batched_tokens=settings.max_num_batched_tokens,
        long_prefill_token_threshold=settings.resolved_long_prefill_token_threshold(),
        max_num_seqs=settings.max_num_seqs,
        transfer_backend=settings.transfer_backend,
        device=settings.device,
        prefix_caching=settings.enable_prefix_caching,
        dram_prefix_caching=settings.dram_prefix_caching,
    )
    log.info("sizing_kv_and_pinning_host_pool", dram_kv_gib=config.dram_kv_gib)
    engine = build_engine(loaded, config, serving=Serving(planner))
    log.info("warming_up")
    warm_up(engine)
    return engine, loaded.config.kv_bytes_per_token * settings.block_size


def host_tier_gib(settings: WorkerSettings) -> float:
    """``--dram-kv-gib``, or vLLM's ``--swap-space`` for the same thing (both: they must agree)."""
    if settings.swap_space is None:
        return settings.dram_kv_gib
    if settings.dram_kv_gib not in (0.0, settings.swap_space):
        raise ValueError(
            f"--swap-space {settings.swap_space} and --dram-kv-gib {settings.dram_kv_gib} "
            "both size the host KV tier; give one"
        )
    return settings.swap_space


class WorkerState:
    """What the health endpoint reports: the worker once its model is loaded, and whether it
    is draining (not ready: finishing what it owns before exiting)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.worker: Worker | None = None

    @property
    def draining(self) -> bool:
        """The worker's own flag (it owns it: set once, when the stop comes)."""
        return self.worker is not None and self.worker.draining


class WorkerCollector(Collector):
    """Prometheus metrics read from the worker at scrape time."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        state, worker = self.state, self.state.worker
        labels = ["worker_id"]
        wid = [state.worker_id]
        loaded = GaugeMetricFamily(
            "superinfer_worker_ready", "1 once the model is loaded and not draining", labels=labels
        )
        loaded.add_metric(wid, float(worker is not None and not state.draining))
        yield loaded
        draining = GaugeMetricFamily(
            "superinfer_worker_draining", "1 while finishing requests before exit", labels=labels
        )
        draining.add_metric(wid, float(state.draining))
        yield draining
        if worker is None:
            return
        iterations = CounterMetricFamily(
            "superinfer_worker_iterations", "engine iterations run", labels=labels
        )
        iterations.add_metric(wid, float(worker.num_iterations))
        yield iterations
        malformed = CounterMetricFamily(
            "superinfer_worker_malformed_messages", "stream messages skipped", labels=labels
        )
        malformed.add_metric(wid, float(worker.num_malformed))
        yield malformed
        engine = worker.engine
        requests = GaugeMetricFamily(
            "superinfer_worker_requests", "requests by state", labels=[*labels, "state"]
        )
        for name, num in (
            ("running", len(engine.running)),
            ("waiting", len(engine.waiting)),
            ("rotary", len(engine.rotary)),
        ):
            requests.add_metric([*wid, name], float(num))
        yield requests
        blocks = GaugeMetricFamily(
            "superinfer_worker_kv_blocks", "KV blocks per tier", labels=[*labels, "tier"]
        )
        free = GaugeMetricFamily(
            "superinfer_worker_kv_free_blocks", "free KV blocks per tier", labels=[*labels, "tier"]
        )
        kv = engine.kv.stats()
        for tier, num_blocks, num_free in (
            ("hbm", kv.num_hbm_blocks, kv.num_free_hbm_blocks),
            ("dram", kv.num_dram_blocks, kv.num_free_dram_blocks),
        ):
            blocks.add_metric([*wid, tier], float(num_blocks))
            free.add_metric([*wid, tier], float(num_free))
        yield blocks
        yield free
        residency = GaugeMetricFamily(
            "superinfer_worker_lvf_min_residency_seconds",
            "LVF's minimum residency the worker plans with (adapted online unless pinned)",
            labels=labels,
        )
        residency.add_metric(wid, worker.planner.min_residency_s)
        yield residency
        for name, help_text, value in (
            ("b_xfer_blocks", "B_xfer in force: KV blocks DuplexKV may move per iteration",
             engine.kv.b_xfer_blocks),
            ("link_bytes_per_s", "measured host link bandwidth, slower direction (0: none)",
             kv.link_bytes_per_s),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(f"superinfer_worker_{name}", help_text, labels=labels)
            gauge.add_metric(wid, float(value))
            yield gauge
        yield from vllm_engine_families([worker.status], worker.model_name)


async def _run_and_drain(
    worker: Worker, state: WorkerState, stop: asyncio.Event, drain_timeout_s: float
) -> None:
    """Run the worker until ``stop``; then stay up (not ready) until it has finished the
    requests it owns (those whose grammar still compiles included), or ``drain_timeout_s``
    passed, and only then stop the worker."""
    worker_stop = asyncio.Event()
    run = asyncio.create_task(worker.run(worker_stop))
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({run, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not run.done():
            worker.draining = True
            loop = asyncio.get_running_loop()
            deadline = loop.time() + drain_timeout_s
            log.info("worker_draining", worker_id=state.worker_id, timeout_s=drain_timeout_s)
            while worker.has_unfinished() and loop.time() < deadline and not run.done():
                await asyncio.sleep(0.05)
            if worker.has_unfinished():
                log.warning("worker_drain_timed_out", worker_id=state.worker_id)
            worker_stop.set()
        await run
    finally:
        stopped.cancel()
        if not run.done():
            worker_stop.set()
            run.cancel()


async def _wait_for_redis(redis: Redis, stop: asyncio.Event) -> None:
    """Until Redis answers (or ``stop``): the worker's start-up commands are not retried."""
    delay_s = 0.05
    while not stop.is_set() and not await redis_reachable(redis):
        log.warning("waiting_for_redis", retry_in_s=delay_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay_s)
        delay_s = min(2.0, delay_s * 2)


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    """Health endpoint first (liveness answers while the model loads in a thread), then the
    worker; on ``stop`` it drains (see :func:`_run_and_drain`). A CUDA device this machine
    lacks is a ConfigError before anything starts."""
    problem = missing_device_problem(settings.device)
    if problem is not None:
        raise ConfigError(problem)
    redis = Redis.from_url(  # a Redis that hangs (not just dies) times out and is retried
        settings.redis_url,
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=settings.redis_timeout_s,
    )
    state = WorkerState(settings.worker_id)
    registry = CollectorRegistry()
    registry.register(WorkerCollector(state))

    async def ready() -> bool:
        return state.worker is not None and not state.draining and await redis_reachable(redis)

    try:
        async with serve_health(settings.health_port, ready, registry, settings.health_host):
            worker = await asyncio.to_thread(build_worker, settings, redis)
            try:
                await _wait_for_redis(redis, stop)
                if stop.is_set():
                    return
                state.worker = worker
                await _run_and_drain(worker, state, stop, settings.drain_timeout_s)
            finally:
                worker.engine.close()
    finally:
        await redis.aclose()
