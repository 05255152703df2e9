"""vLLM's own metric names and labels (``vllm:...{model_name}``), exported beside ours so that a
vLLM Grafana dashboard, a KEDA rule or llm-d's scheduler reads a SuperInfer gateway unchanged
(gateway setting ``vllm_metrics``, on by default).

Request-level series are observed as requests finish, with vLLM's buckets. Engine-level series
are the workers' heartbeat statuses summed at scrape time and labelled with the served model,
never with a worker: ``vllm:kv_cache_usage_perc`` is HBM blocks in use over all HBM blocks of
the live workers (0-1), ``vllm:num_requests_swapped`` (vLLM V0's name) our rotary requests and
``vllm:cpu_cache_usage_perc`` the DRAM tier."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gateway.workers import WorkerDirectory
from shared.metrics_vllm import vllm_engine_families

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
# How a request ends, as vLLM's FinishReason names it (abort: the client left, a timeout, a
# lost worker; error: the worker failed it).
FINISHED_REASONS = ("stop", "length", "abort", "error")

# Every name this module exports (as they appear in Prometheus), for the docs and the tests.
VLLM_SERIES = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_swapped",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cpu_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)


class VllmRequestMetrics:
    """The request-level histograms and counters, labelled ``model_name`` (and
    ``finished_reason`` for ``vllm:request_success_total``)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        label = ["model_name"]

        def histogram(name: str, text: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(f"vllm:{name}", text, label, registry=registry, buckets=buckets)

        self.ttft = histogram("time_to_first_token_seconds", "TTFT", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency", ITL_BUCKETS)
        self.tpot = histogram(
            "time_per_output_token_seconds", "Inter-token latency (older name)", ITL_BUCKETS
        )
        self.request_tpot = histogram(
            "request_time_per_output_token_seconds", "Mean TPOT of a request", ITL_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time waiting", REQUEST_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt tokens", TOKEN_COUNT_BUCKETS)
        self.output_len = histogram(
            "request_generation_tokens", "Generated tokens", TOKEN_COUNT_BUCKETS
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens", label, registry=registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens", label, registry=registry
        )
        self.success = Counter(
            "vllm:request_success", "Finished requests", [*label, "finished_reason"],
            registry=registry,
        )  # fmt: skip
        for reason in FINISHED_REASONS:  # at 0 from the start, as vLLM's
            self.success.labels(model_name, reason)
        for metric in (self.prompt_tokens, self.generation_tokens):
            metric.labels(model_name)
        for family in (self.ttft, self.itl, self.tpot, self.request_tpot, self.e2e, self.queue):
            family.labels(model_name)
        self.prompt_len.labels(model_name)
        self.output_len.labels(model_name)

    def observe_tokens(
        self, num_tokens: int, gaps_s: list[float], ttft_s: float | None, num_prompt_tokens: int
    ) -> None:
        """An output as it arrives: its tokens, the gaps they close, with the first token the
        TTFT and the prompt's tokens (computed by then)."""
        m = self.model_name
        self.generation_tokens.labels(m).inc(num_tokens)
        if num_prompt_tokens:
            self.prompt_tokens.labels(m).inc(num_prompt_tokens)
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
        itl, tpot = self.itl.labels(m), self.tpot.labels(m)
        for gap_s in gaps_s:
            itl.observe(gap_s)
            tpot.observe(gap_s)

    def observe_finished(
        self,
        finish_reason: str,
        gaps_s: list[float],
        e2e_s: float,
        queue_s: float | None,
        num_prompt_tokens: int,
        num_output_tokens: int,
    ) -> None:
        m = self.model_name
        self.success.labels(m, finish_reason).inc()
        self.e2e.labels(m).observe(e2e_s)
        self.prompt_len.labels(m).observe(num_prompt_tokens)
        self.output_len.labels(m).observe(num_output_tokens)
        if queue_s is not None:
            self.queue.labels(m).observe(max(0.0, queue_s))
        if gaps_s:
            self.request_tpot.labels(m).observe(sum(gaps_s) / len(gaps_s))


class VllmEngineCollector(Collector):
    """vLLM's engine series from the live workers' heartbeats, one per worker
    (:mod:`shared.metrics_vllm`)."""

    def __init__(self, directory: WorkerDirectory, model_name: str) -> None:
        self.directory = directory
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        yield from vllm_engine_families(self.directory.alive(), self.model_name)
