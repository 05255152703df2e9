"""The dashboard and the alerts as shipped (no Prometheus needed; test_prometheus.py evaluates
them): the JSON is what lab.grafana builds, the chart carries it for Grafana's sidecar, the
PrometheusRule is off by default and covers what the issue asks, and compose's `observability`
profile provisions the same dashboard and a datasource scraping the gateway."""

from __future__ import annotations

import json
from typing import Any

import yaml

from lab.grafana import DASHBOARD_PATH, build_dashboard, dashboard_json, panel_queries
from tests.deploy.support import REPO
from tests.deploy.test_chart import find, render
from tests.deploy.test_compose import edited_env, load

OBSERVABILITY = REPO / "deploy" / "observability"


def test_dashboard_json_is_current() -> None:
    assert DASHBOARD_PATH.read_text() == dashboard_json(), "run: python -m lab.grafana"


def test_dashboard_covers_the_operators_questions() -> None:
    text = " ".join(expr for _, expr in panel_queries(build_dashboard()))
    for series in (
        "slo_ttft_attained_total", "slo_tbt_attained_gaps_total", "slo_good_requests_total",
        "num_requests_waiting", "num_requests_running", "num_requests_rotary",
        "kv_cache_usage_perc", "num_rotations_out_total", "kv_transfer_bytes_total",
        "plan_source", "superinfer:knob", "num_preemptions_total", "knobs_version",
    ):  # fmt: skip
        assert series in text, series
    names = [v["name"] for v in build_dashboard()["templating"]["list"]]
    assert names == ["datasource", "model_name", "slo_class", "worker"]


def test_chart_ships_the_dashboard_for_the_grafana_sidecar() -> None:
    cm = find(render(), "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["superinfer.json"]) == json.loads(DASHBOARD_PATH.read_text())
    off = render({"metrics": {"grafanaDashboard": {"enabled": False}}})
    assert not [d for d in off if d["metadata"]["name"].endswith("-dashboard")]


def test_prometheus_rule_off_by_default_and_complete_when_on() -> None:
    assert not [d for d in render() if d["kind"] == "PrometheusRule"]
    values: dict[str, Any] = {
        "metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}}
    }
    rule = find(render(values), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert names == {
        "SuperInferTTFTAttainmentLow", "SuperInferTBTAttainmentLow",
        "SuperInferWorkersUnplanned", "SuperInferDramTierFull",
        "SuperInferControlPlaneDown", "SuperInferRedisUnreachable",
    }  # fmt: skip
    targets = {
        r["labels"]["slo_class"]: r["expr"].rsplit("<", 1)[1].strip()
        for r in rules
        if r["alert"] == "SuperInferTTFTAttainmentLow"
    }
    assert targets == {"interactive": "0.95", "standard": "0.9", "batch": "0.9"}


def test_compose_observability_profile_provisions_prometheus_and_grafana() -> None:
    services = load(edited_env())["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["observability"], name
    mounts = services["grafana"]["volumes"]
    assert "./charts/superinfer/dashboards:/etc/grafana/dashboards:ro" in mounts
    provider = yaml.safe_load(
        (OBSERVABILITY / "grafana/provisioning/dashboards/superinfer.yml").read_text()
    )
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/dashboards"
    source = yaml.safe_load(
        (OBSERVABILITY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    scrape = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert jobs["superinfer-gateway"]["static_configs"] == [{"targets": ["gateway:8000"]}]
    (found,) = jobs["superinfer-services"]["dns_sd_configs"]  # by name: absent ones add nothing
    assert set(found["names"]) == {"control-plane", "data-plane", "data-plane-cpu"}
    assert found["port"] == 9090
    assert any(
        v.startswith("./deploy/observability/prometheus.yml:")
        for v in services["prometheus"]["volumes"]
    )
