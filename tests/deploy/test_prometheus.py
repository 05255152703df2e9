"""The operator's view against a real Prometheus: `superinfer serve` (stories260K, LVF, a small
HBM pool with a DRAM tier) under `superinfer bench` load, scraped every second; then every
panel query of the Grafana dashboard, the vLLM-compatible series as a vLLM dashboard queries
them, and the chart's PrometheusRule (loaded by that Prometheus; `promtool check rules`) are
evaluated through Prometheus' HTTP API. An invalid query or an empty answer fails.

Skips without the `prometheus` binary (Debian: `apt-get install -y prometheus`; the test runs
it by hand on a free port with its data in a temp dir). SUPERINFER_WRITE_FIGURES=1 also writes
docs/img/dashboard_panels.png (the panels' series) and docs/img/bench_dashboard_run.png
(`superinfer bench --plot` of the same run)."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from lab.grafana import ANNOTATION_EXPR, DASHBOARD_PATH, build_dashboard, panel_queries
from superinfer.cli import main as cli_main
from tests.deploy.prometheus_support import (
    INSTALL_HINT,
    Prometheus,
    finite_values,
    plot_panels,
    prometheus,
    promtool_check,
    rules_file,
)
from tests.deploy.support import REPO
from tests.deploy.test_chart import find, render
from tests.served import Served, embedded_redis, serve

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason=f"no prometheus binary: {INSTALL_HINT}"
)
RATE_INTERVAL = "20s"
# The PrometheusRule as the test loads it: short window, no `for`, so the alerts it provokes
# (interactive's TTFT objective set to 1 ms) fire within the run.
RULE_VALUES = {"metrics": {"prometheusRule": {"enabled": True, "window": "30s", "for": "0s"}}}
# What a vLLM dashboard asks (vLLM's names and its model_name label, nothing of ours).
_QUANTILE = "histogram_quantile({q}, sum by(le) (rate(vllm:{name}_bucket{{{{{{m}}}}}}[{{r}}])))"
VLLM_QUERIES = (
    *(_QUANTILE.format(q=q, name=name) for q, name in (
        (0.99, "time_to_first_token_seconds"), (0.9, "e2e_request_latency_seconds"),
        (0.5, "inter_token_latency_seconds"), (0.5, "time_per_output_token_seconds"),
        (0.5, "request_queue_time_seconds"),
    )),
    "rate(vllm:prompt_tokens_total{{{m}}}[{r}])",
    "rate(vllm:generation_tokens_total{{{m}}}[{r}])",
    "sum by(finished_reason) (increase(vllm:request_success_total{{{m}}}[{r}]))",
    "vllm:num_requests_running{{{m}}}",
    "vllm:num_requests_waiting{{{m}}}",
    "vllm:kv_cache_usage_perc{{{m}}}",
    "rate(vllm:num_preemptions_total{{{m}}}[{r}])",
)  # fmt: skip
FIGURE_PANELS = (
    "TTFT attainment", "TBT attainment", "Goodput and finished requests", "TTFT p50 / p99",
    "Running / waiting / rotary", "KV usage per tier", "Rotations out / in",
    "KV bytes moved per direction", "Plan source", "Knobs", "LVF minimum residency per worker",
    "Queue depth (waiting)",
)  # fmt: skip


@dataclass
class Run:
    served: Served
    prom: Prometheus
    model: str
    start: float
    end: float  # the load's end: queries are evaluated here


def _load(served: Served, model: str, tokenizer: Path, plot: Path) -> None:
    admin = httpx.Client(base_url=served.url, headers=served.admin_headers, timeout=10)
    classes = admin.get("/admin/v1/slo-classes").json()["classes"]
    classes["interactive"] = {"ttft_s": 0.001, "tbt_s": 0.05}  # unattainable: the alert fires
    assert admin.put("/admin/v1/slo-classes", json=classes).status_code == 200
    assert admin.put("/admin/v1/knobs", json={"policy": "lvf"}).status_code == 200
    later = threading.Timer(5.0, lambda: admin.put("/admin/v1/knobs", json={"alpha": 2.0}))
    later.start()  # a knob change event inside the run
    key = admin.post(  # a tenant for the per-tenant panels, any class allowed
        "/admin/v1/api-keys", json={"tenant": "dash", "slo_class": "interactive"}
    )
    assert key.status_code == 200, key.text
    load = "--trace synthetic:24:32 --rps 3 --duration 10 --class-mix interactive=1,standard=1"
    argv = ["bench", "--base-url", f"{served.url}/v1", "--model", model, *load.split()]
    argv += ["--tokenizer", str(tokenizer), "--api-key", key.json()["api_key"]]
    try:
        assert cli_main([*argv, "--no-progress", "--plot", str(plot), "--seed", "1"]) == 0
    finally:
        later.join()
        admin.close()


@pytest.fixture(scope="module")
def run(stories_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("prometheus")
    rule = find(render(RULE_VALUES), "PrometheusRule")
    args = ["--model", str(stories_path), "--block-size", "4", "--max-num-seqs", "4"]
    args += ["--num-hbm-blocks", "48", "--num-dram-blocks", "512", "--policy", "lvf"]
    with embedded_redis() as redis_url, serve(args, redis_url) as served:
        model = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        target = served.url.removeprefix("http://")
        with prometheus(target, tmp, rules_file(rule, tmp / "rules.yml")) as prom:
            prom.wait_for_series("superinfer:num_requests_running")
            start = time.time()
            figures = os.environ.get("SUPERINFER_WRITE_FIGURES") == "1"
            plot = REPO / "docs/img/bench_dashboard_run.png" if figures else tmp / "bench.png"
            plot.parent.mkdir(parents=True, exist_ok=True)
            _load(served, model, stories_path, plot)
            end = time.time()
            time.sleep(2.5)  # the last scrapes and rule evaluations
            yield Run(served, prom, model, start, end)


def substitute(expr: str, model: str, range_s: float) -> str:
    """Grafana's variables as one user's choice: this model, every class and worker."""
    out = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__range", f"{range_s:.0f}s")
    out = out.replace("$model_name", re.escape(model))
    return out.replace("$slo_class", ".*").replace("$worker", ".*")


def test_every_dashboard_panel_query_answers(run: Run) -> None:
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    queries = panel_queries(dashboard)
    assert len(queries) >= 30
    empty = []
    for title, expr in queries:
        query = substitute(expr, run.model, time.time() - run.start + 5)
        if not finite_values(run.prom.query(query, at=run.end)):
            empty.append(f"{title}: {query}")
    assert not empty, "panels with no (finite) answer:\n" + "\n".join(empty)


def test_knob_changes_show_as_annotations_and_values(run: Run) -> None:
    expr = substitute(ANNOTATION_EXPR, run.model, 0)
    events = run.prom.query_range(expr, run.start - 2, run.end, 1.0)
    assert finite_values(events), "no knob-change annotation during the run"
    alpha = run.prom.query('max(superinfer:knob{name="alpha"})', at=run.end)
    assert finite_values(alpha) == [2.0]
    policy = run.prom.query("superinfer:policy_info", at=run.end)
    assert {s["metric"]["policy"] for s in policy} == {"lvf"}


def test_vllm_dashboard_queries_answer_with_vllm_names(run: Run) -> None:
    selector = f'model_name="{run.model}"'
    for template in VLLM_QUERIES:
        query = template.format(m=selector, r=RATE_INTERVAL)
        assert finite_values(run.prom.query(query, at=run.end)), query
    running = run.prom.query("vllm:num_requests_running", at=run.end)
    expected = {"__name__", "model_name", "engine"}  # one series per worker, as vLLM's engines
    assert [set(s["metric"]) - {"instance", "job"} for s in running] == [expected]
    # The same requests and tokens as ours.
    for ours, theirs in (
        ("superinfer:request_success_total", "vllm:request_success_total"),
        ("superinfer:prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("superinfer:generation_tokens_total", "vllm:generation_tokens_total"),
    ):
        a = finite_values(run.prom.query(f"sum({ours})", at=run.end))
        b = finite_values(run.prom.query(f"sum({theirs})", at=run.end))
        assert a == b and a[0] > 0, (ours, a, b)


def test_rules_pass_promtool_load_and_fire(run: Run, tmp_path: Path) -> None:
    for values in (None, RULE_VALUES):
        if values is None:
            values = {"metrics": {"prometheusRule": {"enabled": True}}}
        rule = find(render(values), "PrometheusRule")
        checked = promtool_check(rules_file(rule, tmp_path / "rules.yml"))
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "SUCCESS" in checked.stdout
    groups = run.prom.get("/api/v1/rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 2 * 3 + 4 and all(r["health"] == "ok" for r in rules), rules
    firing = {
        (a["labels"]["alertname"], a["labels"].get("slo_class"))
        for a in run.prom.get("/api/v1/alerts")["alerts"]
        if a["state"] == "firing"
    }
    assert ("SuperInferTTFTAttainmentLow", "interactive") in firing, firing
    for healthy in (
        "SuperInferControlPlaneDown",
        "SuperInferRedisUnreachable",
        "SuperInferWorkersUnplanned",
    ):
        assert (healthy, None) not in firing


def test_dashboard_figure(run: Run, tmp_path: Path) -> None:
    """The panels' series over the run, from Prometheus (written to docs/img with
    SUPERINFER_WRITE_FIGURES=1, else to a temp file)."""
    by_title: dict[str, list[tuple[str, str]]] = {}
    for panel in build_dashboard()["panels"]:
        targets: list[Any] = panel.get("targets", [])
        span = run.end - run.start + 10
        by_title[panel["title"]] = [
            (substitute(t["expr"], run.model, span), t["legendFormat"]) for t in targets
        ]
    panels = [(title, by_title[title]) for title in FIGURE_PANELS]
    figures = os.environ.get("SUPERINFER_WRITE_FIGURES") == "1"
    path = (REPO / "docs/img" if figures else tmp_path) / "dashboard_panels.png"
    plot_panels(run.prom, panels, (run.start - 2, run.end + 2), path)
    assert path.stat().st_size > 10_000
