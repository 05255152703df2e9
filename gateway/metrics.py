"""Prometheus metrics: vLLM's names under a ``superinfer:`` prefix where the meaning is the
same, plus SLO attainment per class, rotations, bytes per direction and plan source; with
``vllm_metrics``, vLLM's own names beside them (gateway/metrics_vllm.py).

Tokens, TTFT and inter-token gaps are observed as outputs arrive, the rest of the
request-level series as requests finish; worker-level figures are read
from the workers' heartbeat statuses at scrape time (a custom collector, so they are never
stale copies)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.metrics_vllm import VllmEngineCollector, VllmRequestMetrics
from gateway.workers import WorkerDirectory
from shared.policy import kv_usage
from shared.protocol import WorkerStatus

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_NUMERIC_KNOBS = (
    "alpha",
    "beta_b",
    "beta_f",
    "slo_ttft_s",
    "slo_tbt_s",
    "min_residency_s",
    "tpot_headroom_s",
)
_SWITCH_KNOBS = (
    "adaptive_residency", "rotate_only_for_lag", "protect_unserved", "hold_room_for_rotary",
    "tenant_fairness", "deadline_lag", "residency_yields_to_tighter", "lag_per_block", "tpot_lag",
)  # fmt: skip
MAX_TENANT_SERIES = 1024  # tenants whose series /metrics holds at once
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)


class GatewayMetrics:
    def __init__(
        self,
        directory: WorkerDirectory,
        model_name: str,
        vllm: bool = True,
        vllm_engine: bool = True,
    ) -> None:
        """``vllm``: vLLM's names beside ours; ``vllm_engine``: with them, vLLM's engine series
        from the workers' heartbeats (off where the workers' own /metrics are scraped)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name", "slo_class"]
        reg = self.registry
        self.ttft = Histogram(
            "superinfer:time_to_first_token_seconds", "TTFT", labels, registry=reg,
            buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.itl = Histogram(
            "superinfer:inter_token_latency_seconds", "Gap between output tokens", labels,
            registry=reg, buckets=_TOKEN_BUCKETS,
        )  # fmt: skip
        self.e2e = Histogram(
            "superinfer:e2e_request_latency_seconds", "Arrival to last token", labels,
            registry=reg, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue_time = Histogram(
            "superinfer:request_queue_time_seconds", "Arrival to first scheduled", labels,
            registry=reg, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.requests = Counter(
            "superinfer:request_success", "Finished requests by finish reason",
            [*labels, "finished_reason"], registry=reg,
        )  # fmt: skip
        self.rejected = Counter(
            "superinfer:requests_rejected", "Requests refused before any work, by status",
            ["status"], registry=reg,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "superinfer:prompt_tokens",
            "Prompt tokens, counted at the first token",
            labels,
            registry=reg,
        )
        self.generation_tokens = Counter(
            "superinfer:generation_tokens", "Generated tokens", labels, registry=reg
        )
        self.slo_requests = Counter(
            "superinfer:slo_requests", "Requests judged against their class's SLO", ["slo_class"],
            registry=reg,
        )  # fmt: skip
        self.slo_ttft_met = Counter(
            "superinfer:slo_ttft_attained", "Requests with TTFT <= the class's TTFT SLO",
            ["slo_class"], registry=reg,
        )  # fmt: skip
        self.slo_good = Counter(
            "superinfer:slo_good_requests",
            "Requests with TTFT and mean TPOT within the class's SLOs (goodput, as vllm bench)",
            ["slo_class"], registry=reg,
        )  # fmt: skip
        self.slo_tbt_gaps = Counter(
            "superinfer:slo_tbt_gaps", "Inter-token gaps judged", ["slo_class"], registry=reg
        )
        self.slo_tbt_met = Counter(
            "superinfer:slo_tbt_attained_gaps", "Inter-token gaps <= the class's TBT SLO",
            ["slo_class"], registry=reg,
        )  # fmt: skip
        # Per tenant (API keys' tenants: the admin makes them; their series are dropped
        # least recently served first past MAX_TENANT_SERIES, as deleted keys leave theirs)
        self._tenants: OrderedDict[str, None] = OrderedDict()
        self.tenant_requests = Counter(
            "superinfer:tenant_requests", "Finished requests, by tenant", ["tenant"], registry=reg
        )
        self.tenant_ttft_met = Counter(
            "superinfer:tenant_ttft_attained", "Requests within their TTFT SLO, by tenant",
            ["tenant"], registry=reg,
        )  # fmt: skip
        self.tenant_good = Counter(
            "superinfer:tenant_good_requests", "Requests within TTFT and TPOT SLOs, by tenant",
            ["tenant"], registry=reg,
        )  # fmt: skip
        self.tenant_tokens = Counter(
            "superinfer:tenant_tokens", "Prompt and generated tokens served, by tenant",
            ["tenant"], registry=reg,
        )  # fmt: skip
        self.auth_failures = Counter(
            "superinfer:auth_failures", "Failed authentications, by kind (admin, api_key)",
            ["kind"], registry=reg,
        )  # fmt: skip
        self.registry.register(_WorkerCollector(directory, model_name))
        self.vllm: VllmRequestMetrics | None = None
        if vllm:
            self.vllm = VllmRequestMetrics(reg, model_name)
            if vllm_engine:
                reg.register(VllmEngineCollector(directory, model_name))

    def observe_finished(
        self,
        slo_class: str,
        finish_reason: str,
        ttft_s: float | None,
        gaps_s: list[float],
        e2e_s: float,
        queue_s: float | None,
        num_prompt_tokens: int,
        slo_ttft_s: float,
        slo_tbt_s: float,
        tenant: str | None = None,
        *,
        num_output_tokens: int | None = None,
    ) -> None:
        """A finished request (``num_output_tokens``: its generated tokens, by default one per
        gap plus the first)."""
        if num_output_tokens is None:
            num_output_tokens = len(gaps_s) + (ttft_s is not None)
        labels = (self.model_name, slo_class)
        self.requests.labels(*labels, finish_reason).inc()
        self.e2e.labels(*labels).observe(e2e_s)
        if queue_s is not None:
            self.queue_time.labels(*labels).observe(max(0.0, queue_s))
        self.slo_requests.labels(slo_class).inc()
        for counter in (self.slo_ttft_met, self.slo_good, self.slo_tbt_met, self.slo_tbt_gaps):
            counter.labels(slo_class)  # exported at 0 from the class's first request: a class
            # that never meets its objective reads 0 attainment, not "no data"
        ttft_met = ttft_s is not None and ttft_s <= slo_ttft_s
        good = ttft_met and (not gaps_s or sum(gaps_s) / len(gaps_s) <= slo_tbt_s)
        if ttft_met:
            self.slo_ttft_met.labels(slo_class).inc()
        if good:
            self.slo_good.labels(slo_class).inc()
        if tenant is not None:
            num_tokens = num_prompt_tokens + num_output_tokens
            self._observe_tenant(tenant, ttft_met, good, num_tokens)
        self.slo_tbt_gaps.labels(slo_class).inc(len(gaps_s))
        self.slo_tbt_met.labels(slo_class).inc(sum(1 for g in gaps_s if g <= slo_tbt_s))
        if self.vllm is not None:
            self.vllm.observe_finished(
                finish_reason, gaps_s, e2e_s, queue_s, num_prompt_tokens, num_output_tokens
            )

    def observe_tokens(
        self,
        slo_class: str,
        num_tokens: int,
        gaps_s: list[float],
        ttft_s: float | None = None,
        num_prompt_tokens: int = 0,
    ) -> None:
        """An output as it arrives (vLLM counts per engine step): its generated tokens and the
        inter-token gaps they close; with the first token, the TTFT and the prompt's tokens."""
        labels = (self.model_name, slo_class)
        self.generation_tokens.labels(*labels).inc(num_tokens)
        if num_prompt_tokens:
            self.prompt_tokens.labels(*labels).inc(num_prompt_tokens)
        if ttft_s is not None:
            self.ttft.labels(*labels).observe(ttft_s)
        histogram = self.itl.labels(*labels)
        for gap_s in gaps_s:
            histogram.observe(gap_s)
        if self.vllm is not None:
            self.vllm.observe_tokens(num_tokens, gaps_s, ttft_s, num_prompt_tokens)

    def _observe_tenant(self, tenant: str, ttft_met: bool, good: bool, num_tokens: int) -> None:
        self._tenants[tenant] = None
        self._tenants.move_to_end(tenant)
        counters = (self.tenant_requests, self.tenant_ttft_met, self.tenant_good)
        while len(self._tenants) > MAX_TENANT_SERIES:
            gone, _ = self._tenants.popitem(last=False)
            for counter in (*counters, self.tenant_tokens):
                counter.remove(gone)  # back at 0 if it is served again: a reset to Prometheus
        self.tenant_requests.labels(tenant).inc()
        self.tenant_ttft_met.labels(tenant).inc(ttft_met)  # at 0 from the first: 0 attainment
        self.tenant_good.labels(tenant).inc(good)
        self.tenant_tokens.labels(tenant).inc(num_tokens)


class _WorkerCollector(Collector):
    def __init__(self, directory: WorkerDirectory, model_name: str) -> None:
        self.directory = directory
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        statuses = self.directory.alive()
        gauges = {
            name: GaugeMetricFamily(f"superinfer:{name}", help_text, labels=["worker"])
            for name, help_text in (
                ("num_requests_running", "Requests with KV in HBM"),
                ("num_requests_waiting", "Requests waiting for admission"),
                ("num_requests_rotary", "Requests parked in host DRAM"),
                ("iteration_time_seconds", "Mean engine iteration time"),
                ("lvf_min_residency_seconds", "LVF's current minimum residency"),
                ("b_xfer_blocks", "B_xfer in force: KV blocks DuplexKV may move per iteration"),
                ("link_bytes_per_s", "Measured host link bandwidth (0: none measured)"),
            )
        }
        usage = GaugeMetricFamily(
            "superinfer:kv_cache_usage_perc", "KV blocks in use (0-1)", labels=["worker", "tier"]
        )
        source = GaugeMetricFamily(
            "superinfer:plan_source", "1 for the worker's current plan source",
            labels=["worker", "source"],
        )  # fmt: skip
        counters = {
            name: CounterMetricFamily(f"superinfer:{name}", help_text, labels=["worker"])
            for name, help_text in (
                ("num_preemptions", "Preemptions by recompute"),
                ("num_rotations_out", "Requests rotated out to host DRAM"),
                ("num_rotations_in", "Requests rotated back into HBM"),
            )
        }
        moved = CounterMetricFamily(
            "superinfer:kv_transfer_bytes", "KV bytes moved", labels=["worker", "direction"]
        )
        prefix = _prefix_cache_families(statuses)
        for s in statuses:
            w = s.worker_id
            gauges["num_requests_running"].add_metric([w], s.num_running)
            gauges["num_requests_waiting"].add_metric([w], s.num_waiting)
            gauges["num_requests_rotary"].add_metric([w], s.num_rotary)
            gauges["iteration_time_seconds"].add_metric([w], s.iteration_time_s)
            if s.lvf_min_residency_s is not None:
                gauges["lvf_min_residency_seconds"].add_metric([w], s.lvf_min_residency_s)
            gauges["b_xfer_blocks"].add_metric([w], s.b_xfer_blocks)
            gauges["link_bytes_per_s"].add_metric([w], s.link_bytes_per_s)
            usage.add_metric([w, "hbm"], kv_usage(s.num_hbm_blocks, s.num_free_hbm_blocks))
            usage.add_metric([w, "dram"], kv_usage(s.num_dram_blocks, s.num_free_dram_blocks))
            source.add_metric([w, s.plan_source], 1.0)
            counters["num_preemptions"].add_metric([w], s.num_preemptions)
            counters["num_rotations_out"].add_metric([w], s.num_rotations_out)
            counters["num_rotations_in"].add_metric([w], s.num_rotations_in)
            moved.add_metric([w, "h2d"], s.bytes_h2d)
            moved.add_metric([w, "d2h"], s.bytes_d2h)
        yield from gauges.values()
        yield from (usage, source, *counters.values(), moved, *prefix)
        yield from self._knobs()

    def _knobs(self) -> Iterator[Metric]:
        d = self.directory
        knobs = GaugeMetricFamily(
            "superinfer:knob", "Current SLO knobs (switches: 1 on, 0 off)", labels=["name"]
        )
        for name in _NUMERIC_KNOBS + _SWITCH_KNOBS:
            knobs.add_metric([name], float(getattr(d.knobs, name)))
        knobs.add_metric(["b_xfer"], -1.0 if d.knobs.b_xfer is None else float(d.knobs.b_xfer))
        for name in ("demote_late_s", "max_pause_s"):  # -1: off
            value = getattr(d.knobs, name)
            knobs.add_metric([name], -1.0 if value is None else value)
        policy = GaugeMetricFamily("superinfer:policy_info", "Current policy", labels=["policy"])
        policy.add_metric([d.knobs.policy], 1.0)
        version = GaugeMetricFamily("superinfer:knobs_version", "Version of the knobs hash")
        version.add_metric([], d.knobs_version)
        cp = GaugeMetricFamily("superinfer:control_plane_up", "1 while the control plane beats")
        cp.add_metric([], 1.0 if d.control_plane_alive else 0.0)
        redis = GaugeMetricFamily("superinfer:redis_up", "1 while this gateway reaches Redis")
        redis.add_metric([], 1.0 if d.redis_ok else 0.0)
        yield from (knobs, policy, version, cp, redis)


def _prefix_cache_families(statuses: list[WorkerStatus]) -> tuple[Metric, ...]:
    """Prefix caching per worker: tokens looked up at admission, hits per tier (vLLM's
    prefix_cache_queries / prefix_cache_hits, plus the tier) and the blocks each index holds."""
    queries = CounterMetricFamily(
        "superinfer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
        labels=["worker"],
    )  # fmt: skip
    hits = CounterMetricFamily(
        "superinfer:prefix_cache_hits", "Prompt tokens found cached, per tier",
        labels=["worker", "tier"],
    )  # fmt: skip
    cached = GaugeMetricFamily(
        "superinfer:prefix_cache_blocks", "KV blocks indexed by content, per tier",
        labels=["worker", "tier"],
    )  # fmt: skip
    for s in statuses:
        w = s.worker_id
        queries.add_metric([w], s.num_prefix_queried_tokens)
        hits.add_metric([w, "hbm"], s.num_prefix_hbm_hit_tokens)
        hits.add_metric([w, "dram"], s.num_prefix_dram_hit_tokens)
        cached.add_metric([w, "hbm"], s.num_cached_hbm_blocks)
        cached.add_metric([w, "dram"], s.num_cached_dram_blocks)
    return queries, hits, cached
