"""vLLM-compatible series: the names and labels vLLM exports, engine series one per worker
(label ``engine``, as vLLM's per-engine series), tokens and latencies observed as outputs
arrive, the rest once per finish, and the settings turning them off."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from gateway.metrics_vllm import VLLM_SERIES
from gateway.settings import GatewaySettings
from gateway.workers import WorkerDirectory
from shared.policy import Knobs
from shared.protocol import WorkerStatus


def _status(worker_id: str, **changes: Any) -> WorkerStatus:
    fields: dict[str, Any] = dict(
        worker_id=worker_id, epoch="e1", t_heartbeat_s=time.time(), model_name="m",
        max_model_len=512, num_running=3, num_waiting=5, num_rotary=2, num_waiting_tokens=100,
        num_hbm_blocks=100, num_free_hbm_blocks=40, num_dram_blocks=400, num_free_dram_blocks=300,
        max_num_batched_tokens=2048, iteration_time_s=0.02, plan_source="remote", policy="lvf",
        num_preemptions=4, num_rotations_out=7, num_rotations_in=6, bytes_h2d=10, bytes_d2h=20,
        accepting=True, lvf_min_residency_s=0.5, num_prefix_queried_tokens=1000,
        num_prefix_hbm_hit_tokens=300, num_prefix_dram_hit_tokens=100, num_cached_hbm_blocks=9,
        num_cached_dram_blocks=30, b_xfer_blocks=120, link_bytes_per_s=2.5e9,
    )  # fmt: skip
    return WorkerStatus(**{**fields, **changes})


def _metrics(vllm: bool = True, vllm_engine: bool = True) -> GatewayMetrics:
    directory = WorkerDirectory(None, GatewaySettings(admin_disabled=True))  # type: ignore[arg-type]
    directory.statuses = {
        "w0": _status("w0"),
        "w1": _status("w1", num_running=1, num_hbm_blocks=300, num_free_hbm_blocks=260),
        "dead": _status("dead", t_heartbeat_s=time.time() - 3600, num_running=50),
    }
    return GatewayMetrics(directory, "tiny", vllm=vllm, vllm_engine=vllm_engine)


def _samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _finish(metrics: GatewayMetrics) -> None:
    """A request's outputs as they arrive (its first token with 12 prompt tokens after 0.3 s,
    three more), then its finish."""
    metrics.observe_tokens("interactive", 1, [], ttft_s=0.3, num_prompt_tokens=12)
    metrics.observe_tokens("interactive", 2, [0.02, 0.04])
    metrics.observe_tokens("interactive", 1, [0.2])
    metrics.observe_finished(
        "interactive", "stop", ttft_s=0.3, gaps_s=[0.02, 0.04, 0.2], e2e_s=0.6, queue_s=0.1,
        num_prompt_tokens=12, slo_ttft_s=1.0, slo_tbt_s=0.05,
    )  # fmt: skip


def test_engine_series_are_one_per_live_worker_as_vllms_per_engine() -> None:
    """vLLM labels each engine's series (model_name, engine): a worker's counters are its own
    process's, so one that dies or restarts never makes another's series go backwards (a
    sum over the live workers did: a reset to Prometheus, counted again by rate())."""
    samples = _samples(_metrics())

    def engine(worker_id: str) -> tuple[tuple[str, str], ...]:
        return (("engine", worker_id), ("model_name", "tiny"))

    assert samples[("vllm:num_requests_running", engine("w0"))] == 3
    assert samples[("vllm:num_requests_running", engine("w1"))] == 1  # the dead worker is out
    assert ("vllm:num_requests_running", engine("dead")) not in samples
    assert samples[("vllm:num_requests_waiting", engine("w0"))] == 5
    assert samples[("vllm:num_requests_swapped", engine("w1"))] == 2
    assert samples[("vllm:kv_cache_usage_perc", engine("w0"))] == 0.6  # 60 of 100 in use
    assert samples[("vllm:gpu_cache_usage_perc", engine("w1"))] == 40 / 300
    assert samples[("vllm:cpu_cache_usage_perc", engine("w0"))] == 0.25
    assert samples[("vllm:num_preemptions_total", engine("w0"))] == 4
    assert samples[("vllm:prefix_cache_queries_total", engine("w1"))] == 1000
    assert samples[("vllm:prefix_cache_hits_total", engine("w0"))] == 400  # both tiers
    assert (
        _samples(_metrics(vllm_engine=False))
        .keys()
        .isdisjoint({("vllm:num_requests_running", engine("w0"))})
    )


def test_request_series_exist_at_zero_before_any_request() -> None:
    """vLLM creates each finished_reason's counter and the token counters at 0: the first
    event then counts in increase(), and a query finds a series before any request."""
    samples = _samples(_metrics())
    model = (("model_name", "tiny"),)
    for reason in ("stop", "length", "abort", "error"):
        key = ("vllm:request_success_total", (("finished_reason", reason), *model))
        assert samples[key] == 0
    assert samples[("vllm:generation_tokens_total", model)] == 0
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 0


def test_request_series_carry_vllm_names_labels_and_buckets() -> None:
    metrics = _metrics()
    _finish(metrics)
    samples = _samples(metrics)
    model = (("model_name", "tiny"),)
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 1
    assert samples[("vllm:time_to_first_token_seconds_sum", model)] == 0.3
    assert samples[("vllm:inter_token_latency_seconds_count", model)] == 3
    assert samples[("vllm:time_per_output_token_seconds_count", model)] == 3
    # vLLM's ITL buckets: 0.025 holds one gap (0.02), 0.05 two.
    assert samples[("vllm:inter_token_latency_seconds_bucket", (("le", "0.025"), *model))] == 1
    assert samples[("vllm:inter_token_latency_seconds_bucket", (("le", "0.05"), *model))] == 2
    assert samples[("vllm:request_time_per_output_token_seconds_count", model)] == 1
    assert samples[("vllm:e2e_request_latency_seconds_sum", model)] == 0.6
    assert samples[("vllm:request_queue_time_seconds_sum", model)] == 0.1
    assert samples[("vllm:prompt_tokens_total", model)] == 12
    assert samples[("vllm:generation_tokens_total", model)] == 4  # first token + 3 gaps
    reason = (("finished_reason", "stop"), ("model_name", "tiny"))
    assert samples[("vllm:request_success_total", reason)] == 1
    # Ours are unchanged beside them.
    interactive = (("slo_class", "interactive"),)
    assert samples[("superinfer:slo_ttft_attained_total", interactive)] == 1
    # Mean TPOT 0.087 s > the class's 0.05 s: TTFT met, not goodput.
    assert samples[("superinfer:slo_good_requests_total", interactive)] == 0


def test_every_listed_series_is_exported() -> None:
    metrics = _metrics()
    _finish(metrics)
    names = {name for name, _ in _samples(metrics)}
    for series in VLLM_SERIES:
        assert {series, f"{series}_count"} & names, series


def test_vllm_metrics_off_exports_only_ours() -> None:
    metrics = _metrics(vllm=False)
    _finish(metrics)
    names = {name for name, _ in _samples(metrics)}
    assert not [n for n in names if n.startswith("vllm:")]
    assert "superinfer:num_requests_running" in names


def test_worker_series_keep_the_worker_label_and_residency() -> None:
    samples = _samples(_metrics())
    assert samples[("superinfer:num_requests_running", (("worker", "w1"),))] == 1
    assert samples[("superinfer:lvf_min_residency_seconds", (("worker", "w0"),))] == 0.5
    assert samples[("superinfer:b_xfer_blocks", (("worker", "w0"),))] == 120  # auto, resolved
    assert samples[("superinfer:link_bytes_per_s", (("worker", "w0"),))] == 2.5e9
    assert samples[("superinfer:knob", (("name", "b_xfer"),))] == -1.0  # the knob: auto
    assert samples[("superinfer:knob", (("name", "adaptive_residency"),))] == 1.0
    knob = samples[("superinfer:knob", (("name", "min_residency_s"),))]
    assert knob == Knobs().min_residency_s  # the knob (the floor), beside the worker's value
    assert samples[("superinfer:redis_up", ())] == 0.0  # never refreshed


def test_goodput_counts_requests_within_both_slos() -> None:
    metrics = _metrics()
    for gaps in ([0.01, 0.02], [0.01, 0.2], []):
        metrics.observe_finished("batch", "stop", 0.5, gaps, 1.0, 0.1, 3, 1.0, 0.05)
    metrics.observe_finished("batch", "stop", 2.0, [0.01], 3.0, 0.1, 3, 1.0, 0.05)  # TTFT late
    samples = _samples(metrics)
    assert samples[("superinfer:slo_good_requests_total", (("slo_class", "batch"),))] == 2


def test_a_class_that_never_attains_reads_zero_not_absent() -> None:
    metrics = _metrics()
    metrics.observe_finished("gold", "stop", 2.0, [], 2.0, 0.1, 3, 1.0, 0.05)
    samples = _samples(metrics)
    gold = (("slo_class", "gold"),)
    assert samples[("superinfer:slo_requests_total", gold)] == 1
    for name in ("slo_ttft_attained", "slo_good_requests", "slo_tbt_attained_gaps"):
        assert samples[(f"superinfer:{name}_total", gold)] == 0, name


def test_vllm_metrics_setting_reads_the_environment(monkeypatch: Any) -> None:
    monkeypatch.setenv("SUPERINFER_VLLM_METRICS", "0")
    assert GatewaySettings().vllm_metrics is False
    monkeypatch.delenv("SUPERINFER_VLLM_METRICS")
    assert GatewaySettings().vllm_metrics is True


def test_prefix_cache_series_per_worker_and_tier() -> None:
    samples = _samples(_metrics())
    w0 = (("worker", "w0"),)
    assert samples[("superinfer:prefix_cache_queries_total", w0)] == 1000
    assert samples[("superinfer:prefix_cache_hits_total", (("tier", "hbm"), *w0))] == 300
    assert samples[("superinfer:prefix_cache_hits_total", (("tier", "dram"), *w0))] == 100
    assert samples[("superinfer:prefix_cache_blocks", (("tier", "dram"), *w0))] == 30


def test_per_tenant_attainment_and_service() -> None:
    metrics = _metrics()
    metrics.observe_finished("batch", "stop", 0.5, [0.01, 0.02], 1.0, 0.1, 3, 1.0, 0.05, "acme")
    metrics.observe_finished("batch", "stop", 2.0, [0.01], 3.0, 0.1, 4, 1.0, 0.05, "acme")
    metrics.observe_finished("batch", "stop", 2.0, [], 2.0, 0.1, 5, 1.0, 0.05, "zeta")
    metrics.observe_finished("batch", "stop", 0.5, [], 1.0, 0.1, 5, 1.0, 0.05)  # no tenant
    samples = _samples(metrics)
    acme, zeta = (("tenant", "acme"),), (("tenant", "zeta"),)
    assert samples[("superinfer:tenant_requests_total", acme)] == 2
    assert samples[("superinfer:tenant_ttft_attained_total", acme)] == 1
    assert samples[("superinfer:tenant_good_requests_total", acme)] == 1
    assert samples[("superinfer:tenant_tokens_total", acme)] == (3 + 3) + (4 + 2)
    assert samples[("superinfer:tenant_ttft_attained_total", zeta)] == 0  # present, at 0
    assert {labels for name, labels in samples if name == "superinfer:tenant_requests_total"} == {
        acme,
        zeta,
    }


def test_tenant_series_are_bounded_least_recently_served_dropped(monkeypatch: Any) -> None:
    """Keys come and go (each deleted key's tenant left its series forever): past the cap the
    least recently served tenant's series go; a tenant served again starts at 0."""
    from gateway import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "MAX_TENANT_SERIES", 3)
    metrics = _metrics()
    for tenant in ("a", "b", "c", "a", "d"):  # "b" is then the least recently served
        metrics.observe_finished("batch", "stop", 0.5, [], 1.0, 0.1, 5, 1.0, 0.05, tenant)
    samples = _samples(metrics)
    served = {dict(k)["tenant"] for n, k in samples if n == "superinfer:tenant_requests_total"}
    assert served == {"a", "c", "d"}
    assert samples[("superinfer:tenant_requests_total", (("tenant", "a"),))] == 2
    assert not [n for n, k in samples if dict(k).get("tenant") == "b"]
