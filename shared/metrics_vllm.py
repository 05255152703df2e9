"""vLLM's engine-level series (``vllm:num_requests_running``, KV usage, preemptions, prefix-cache
counters) from worker statuses, one series per worker (labels ``model_name`` and ``engine``,
the worker's id, as vLLM labels each engine): exported by each worker's own /metrics and, with
the gateway's ``vllm_engine_metrics``, by a gateway from the workers' heartbeats. A counter is
its worker process's: it only restarts (a new series start to Prometheus) when that worker
does, never drops when another worker goes away."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shared.protocol import WorkerStatus

LABELS = ["model_name", "engine"]


def _fraction(used: int, total: int) -> float:
    return used / total if total > 0 else 0.0


def vllm_engine_families(statuses: Sequence[WorkerStatus], model_name: str) -> Iterator[Metric]:
    """The families, one sample per status (none: each family empty)."""
    gauges = (
        ("num_requests_running", "Requests in the batch", lambda s: s.num_running),
        ("num_requests_waiting", "Requests waiting", lambda s: s.num_waiting),
        ("num_requests_swapped", "Requests in host DRAM", lambda s: s.num_rotary),
        ("kv_cache_usage_perc", "HBM KV usage (0-1)", _hbm_usage),
        ("gpu_cache_usage_perc", "HBM KV usage (older name)", _hbm_usage),
        ("cpu_cache_usage_perc", "DRAM KV usage (0-1)", _dram_usage),
    )
    for name, text, value in gauges:
        gauge = GaugeMetricFamily(f"vllm:{name}", text, labels=LABELS)
        for status in statuses:
            gauge.add_metric([model_name, status.worker_id], float(value(status)))
        yield gauge
    counters = (
        ("num_preemptions", "Preemptions by recompute", lambda s: s.num_preemptions),
        (
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            lambda s: s.num_prefix_queried_tokens,
        ),
        (
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache (either tier)",
            lambda s: s.num_prefix_hbm_hit_tokens + s.num_prefix_dram_hit_tokens,
        ),
    )
    for name, text, value in counters:
        counter = CounterMetricFamily(f"vllm:{name}", text, labels=LABELS)
        for status in statuses:
            counter.add_metric([model_name, status.worker_id], float(value(status)))
        yield counter


def _hbm_usage(status: WorkerStatus) -> float:
    return _fraction(status.num_hbm_blocks - status.num_free_hbm_blocks, status.num_hbm_blocks)


def _dram_usage(status: WorkerStatus) -> float:
    return _fraction(status.num_dram_blocks - status.num_free_dram_blocks, status.num_dram_blocks)
