"""The Grafana dashboard of SuperInfer, built here and written as JSON to the chart
(charts/superinfer/dashboards/superinfer.json: the Grafana sidecar's ConfigMap, and compose's
`observability` profile mounts the same file). Every panel reads the gateways' /metrics.

    .venv/bin/python -m lab.grafana            # rewrite the JSON
    .venv/bin/python -m lab.grafana --check    # exit 1 when the JSON is stale

Worker series come from every gateway (each reads the workers' heartbeats), so a per-worker
figure is ``max by (worker)`` over gateways and "all workers" the sum of that. Variables:
``$datasource``, ``$model_name``, ``$slo_class``, ``$worker`` (regex matchers, "All" = ``.*``);
Grafana's ``$__rate_interval`` and ``$__range``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DASHBOARD_PATH = (
    Path(__file__).resolve().parents[1] / "charts/superinfer/dashboards/superinfer.json"
)
R = "[$__rate_interval]"
CLS = 'slo_class=~"$slo_class"'
W = 'worker=~"$worker"'
MODEL = 'model_name=~"$model_name"'

Target = tuple[str, str]  # (PromQL, legend)


def per_worker(metric: str, label: str = "", rate: bool = False) -> list[Target]:
    """The metric summed over workers ("all") and per worker (deduplicated over gateways)."""
    series = f"{metric}{{{W}}}"
    if rate:
        series = f"rate({series}{R})"
    return [
        (f"sum(max by (worker) ({series}))", f"all {label}".strip()),
        (f"max by (worker) ({series})", f"{{{{worker}}}} {label}".strip()),
    ]


def ratio(good: str, total: str) -> str:
    by = "sum by (slo_class) "
    return f"{by}(rate({good}{{{CLS}}}{R})) / {by}(rate({total}{{{CLS}}}{R}))"


def quantiles(metric: str) -> list[Target]:
    sel = f"{metric}_bucket{{{MODEL}, {CLS}}}"
    rate = f"sum by (le, slo_class) (rate({sel}{R}))"
    legend = "{{slo_class}} "
    return [(f"histogram_quantile({q}, {rate})", legend + name) for q, name in QUANTILES]


def rate_by(labels: str, metric: str, selector: str) -> str:
    return f"sum by ({labels}) (rate({metric}{{{selector}}}{R}))"


def worker_max(labels: str, series: str) -> str:
    return f"max by (worker, {labels}) ({series})"


QUANTILES = ((0.5, "p50"), (0.99, "p99"))
KV_USAGE = f"superinfer:kv_cache_usage_perc{{{W}}}"
BYTES = f"rate(superinfer:kv_transfer_bytes_total{{{W}}}{R})"
PREFIX_HITS = f"rate(superinfer:prefix_cache_hits_total{{{W}}}{R})"
PREFIX_QUERIES = f"max by (worker) (rate(superinfer:prefix_cache_queries_total{{{W}}}{R}))"
KNOBS = 'superinfer:knob{name=~"alpha|beta_b|beta_f|min_residency_s"}'
ATTAINED = {
    "TTFT": ("superinfer:slo_ttft_attained_total", "superinfer:slo_requests_total"),
    "TBT": ("superinfer:slo_tbt_attained_gaps_total", "superinfer:slo_tbt_gaps_total"),
}

# (row title, [(panel title, unit, [targets], description)])
PanelSpec = tuple[str, str, list[Target], str]
ROWS: list[tuple[str, list[PanelSpec]]] = [
    ("SLO attainment per class", [
        ("TTFT attainment", "percentunit", [(ratio(*ATTAINED["TTFT"]), "{{slo_class}}")],
         "Finished requests whose first token came within their class's TTFT objective."),
        ("TBT attainment", "percentunit", [(ratio(*ATTAINED["TBT"]), "{{slo_class}}")],
         "Inter-token gaps within the class's TBT objective."),
        ("Goodput and finished requests", "reqps",
         [(rate_by("slo_class", "superinfer:slo_good_requests_total", CLS),
           "{{slo_class}} goodput"),
          (rate_by("slo_class", "superinfer:slo_requests_total", CLS), "{{slo_class}} finished")],
         "Goodput: requests per second with TTFT and mean TPOT within their class's SLOs."),
        ("Finish reasons", "reqps",
         [(rate_by("finished_reason", "superinfer:request_success_total", MODEL),
           "{{finished_reason}}")], ""),
        ("TTFT p50 / p99", "s", quantiles("superinfer:time_to_first_token_seconds"), ""),
        ("Inter-token latency p50 / p99", "s",
         quantiles("superinfer:inter_token_latency_seconds"), ""),
    ]),
    ("Tenants (API keys' tenants)", [
        ("TTFT attainment per tenant", "percentunit",
         [(f"sum by (tenant) (rate(superinfer:tenant_ttft_attained_total{R}))"
           f" / sum by (tenant) (rate(superinfer:tenant_requests_total{R}))", "{{tenant}}")],
         "Finished requests of each tenant within their TTFT objective (tenant_fairness knob: "
         "no tenant starved by another that floods the server)."),
        ("Service per tenant", "short",
         [(f"sum by (tenant) (rate(superinfer:tenant_tokens_total{R}))", "{{tenant}} tokens/s"),
          (f"sum by (tenant) (rate(superinfer:tenant_good_requests_total{R}))",
           "{{tenant}} goodput req/s")],
         "Prompt and generated tokens served per second, and requests within both SLOs."),
    ]),
    ("Load and KV memory (per worker, and all workers)", [
        ("Queue depth (waiting)", "short", per_worker("superinfer:num_requests_waiting"), ""),
        ("Running / waiting / rotary", "short",
         per_worker("superinfer:num_requests_running", "running")[:1]
         + per_worker("superinfer:num_requests_waiting", "waiting")[:1]
         + per_worker("superinfer:num_requests_rotary", "rotary"),
         "Rotary: requests whose KV is parked in host DRAM."),
        ("KV usage per tier", "percentunit",
         [(worker_max("tier", KV_USAGE), "{{worker}} {{tier}}"),
          (f"avg by (tier) ({worker_max('tier', KV_USAGE)})", "mean {{tier}}")],
         "HBM and host DRAM blocks in use."),
        ("Iteration time", "s", per_worker("superinfer:iteration_time_seconds")[1:], ""),
        ("Prefix cache: prompt tokens found, per tier", "percentunit",
         [(f"sum by (tier) ({worker_max('tier', PREFIX_HITS)})"
           f" / ignoring (tier) group_left sum({PREFIX_QUERIES})", "{{tier}}")],
         "Share of the prompt tokens looked up at admission found cached in HBM or, past what "
         "HBM holds, in host DRAM (loaded by H2D copies instead of prefilled)."),
        ("Prefix cache: cached blocks per tier", "short",
         [(worker_max("tier", f"superinfer:prefix_cache_blocks{{{W}}}"), "{{worker}} {{tier}}")],
         "KV blocks indexed by content (in use or evictable)."),
    ]),
    ("Rotation and transfers", [
        ("Rotations out / in", "ops",
         per_worker("superinfer:num_rotations_out_total", "out", rate=True)
         + per_worker("superinfer:num_rotations_in_total", "in", rate=True)[:1], ""),
        ("KV bytes moved per direction", "Bps",
         [(f"sum by (direction) ({worker_max('direction', BYTES)})", "all {{direction}}"),
          (worker_max("direction", BYTES), "{{worker}} {{direction}}")],
         "h2d: rotations back in; d2h: eager sync and rotations out."),
        ("Preemptions by recompute", "ops",
         per_worker("superinfer:num_preemptions_total", rate=True), ""),
        ("Plan source", "short",
         [(f"count by (source) ({worker_max('source', f'superinfer:plan_source{{{W}}}')})",
           "{{source}} workers")],
         "Workers following the control plane's plans (remote) or planning locally."),
    ]),
    ("Knobs and control", [
        ("Knobs", "short",
         [(f"max by (name) ({KNOBS})", "{{name}}")],
         "PUT /admin/v1/knobs changes them; annotations mark each change."),
        ("Transfer budget knob b_xfer", "short",
         [('max(superinfer:knob{name="b_xfer"})', "b_xfer blocks/iteration (-1: auto)")], ""),
        ("LVF minimum residency per worker", "s",
         per_worker("superinfer:lvf_min_residency_seconds")[1:],
         "The adaptive controller's current value (or the pinned knob)."),
        ("Policy, knob changes", "short",
         [("max by (policy) (superinfer:policy_info)", "policy {{policy}}"),
          ("max(changes(superinfer:knobs_version[$__range]))", "knob changes in range")], ""),
        ("Control plane and Redis", "short",
         [("min(superinfer:control_plane_up)", "control plane up"),
          ("min(superinfer:redis_up)", "redis reachable (min over gateways)")], ""),
    ]),
]  # fmt: skip

ANNOTATION_EXPR = "max(changes(superinfer:knobs_version[$__rate_interval])) > 0"


def _datasource() -> dict[str, str]:
    return {"type": "prometheus", "uid": "${datasource}"}


def _panel(spec: PanelSpec, panel_id: int, x: int, y: int) -> dict[str, Any]:
    title, unit, targets, description = spec
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": _datasource(),
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(65 + i), "expr": e, "legendFormat": lf, "datasource": _datasource()}
            for i, (e, lf) in enumerate(targets)
        ],
    }  # fmt: skip


def _variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "query",
        "datasource": _datasource(),
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
        "sort": 1,
    }


def _templating() -> dict[str, Any]:
    source = {
        "name": "datasource",
        "type": "datasource",
        "query": "prometheus",
        "label": "Data source",
    }
    return {
        "list": [
            source,
            _variable("model_name", "label_values(superinfer:request_success_total, model_name)"),
            _variable("slo_class", "label_values(superinfer:slo_requests_total, slo_class)"),
            _variable("worker", "label_values(superinfer:num_requests_running, worker)"),
        ]
    }  # fmt: skip


def build_dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y, panel_id = 0, 1
    for row_title, specs in ROWS:
        row = {"id": panel_id, "type": "row", "title": row_title, "collapsed": False}
        panels.append({**row, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y, panel_id = y + 1, panel_id + 1
        for index, spec in enumerate(specs):
            panels.append(_panel(spec, panel_id, 12 * (index % 2), y + 8 * (index // 2)))
            panel_id += 1
        y += 8 * ((len(specs) + 1) // 2)
    annotation = {
        "name": "Knob changes", "enable": True, "iconColor": "orange", "datasource": _datasource(),
        "expr": ANNOTATION_EXPR, "step": "15s", "titleFormat": "knobs changed",
    }  # fmt: skip
    return {
        "uid": "superinfer",
        "title": "SuperInfer",
        "tags": ["superinfer", "llm", "slo"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": _templating(),
        "annotations": {"list": [annotation]},
        "panels": panels,
    }


def dashboard_json() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target, rows' panels included."""
    out = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            out += [(inner["title"], t["expr"]) for t in inner.get("targets", [])]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write or check the Grafana dashboard JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    text = dashboard_json()
    if args.check:
        current = DASHBOARD_PATH.read_text() if DASHBOARD_PATH.exists() else ""
        if current != text:
            print(f"{DASHBOARD_PATH} is stale: run python -m lab.grafana", file=sys.stderr)
            return 1
        return 0
    DASHBOARD_PATH.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_PATH.write_text(text)
    print(f"wrote {DASHBOARD_PATH} ({len(panel_queries(build_dashboard()))} queries)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
