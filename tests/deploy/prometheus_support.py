"""A real Prometheus for tests (Debian's `prometheus` package: the binary run by hand, never the
system service), its HTTP API, the chart's rules as a rule file, and the figure of a dashboard's
series (matplotlib) that docs/observability embeds."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.served import free_port

INSTALL_HINT = "apt-get install -y prometheus (Debian/Ubuntu), or put `prometheus` on PATH"


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result vector; AssertionError naming the query on any error."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        return self._get("/api/v1/query", params, expr)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        params = {"query": expr, "start": start, "end": end, "step": step}
        return self._get("/api/v1/query_range", params, expr)

    def _get(self, path: str, params: Mapping[str, Any], expr: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def get(self, path: str) -> Any:
        return httpx.get(f"{self.url}{path}", timeout=10).json()["data"]

    def wait_for_series(self, expr: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.query(expr):
                return
            time.sleep(0.25)
        raise TimeoutError(f"no {expr} in Prometheus after {timeout_s} s")


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    values = [float(s["value"][1]) for s in result if "value" in s]
    values += [float(v) for s in result for _, v in s.get("values", [])]
    return [v for v in values if math.isfinite(v)]


def rules_file(prometheus_rule: dict[str, Any], path: Path) -> Path:
    """The rule groups of a rendered PrometheusRule, as a Prometheus rule file."""
    path.write_text(yaml.safe_dump({"groups": prometheus_rule["spec"]["groups"]}))
    return path


def promtool_check(path: Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool, f"promtool is missing ({INSTALL_HINT})"
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)


@contextmanager
def prometheus(target: str, workdir: Path, rule_file: Path | None = None) -> Iterator[Prometheus]:
    """Prometheus scraping http://``target``/metrics every second, evaluating every second."""
    binary = shutil.which("prometheus")
    assert binary, INSTALL_HINT
    config: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "superinfer", "static_configs": [{"targets": [target]}]}],
    }
    if rule_file is not None:
        config["rule_files"] = [str(rule_file)]
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    command = [
        binary, f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
    ]  # fmt: skip
    log = (workdir / "prometheus.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, workdir / "prometheus.log")
        yield Prometheus(url, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("prometheus not ready after 30 s")


def plot_panels(
    prom: Prometheus,
    panels: list[tuple[str, list[tuple[str, str]]]],
    window: tuple[float, float],
    path: Path,
) -> None:
    """A grid of the panels' series over ``window`` (Prometheus' answers), one legend entry per
    series (Grafana's legendFormat: ``{{label}}`` replaced by the series' label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 3
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(15, 3.1 * rows), squeeze=False)
    start, end = window
    for ax, (title, targets) in zip(axes.flat, panels, strict=False):
        for expr, legend in targets:
            for series in prom.query_range(expr, start, end, 1.0):
                points = [(float(t) - start, float(v)) for t, v in series["values"]]
                label = _legend(legend, series["metric"])
                ax.plot([p[0] for p in points], [p[1] for p in points], label=label, lw=1.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("s", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(
        "SuperInfer dashboard panels: Prometheus' answers during tests/deploy/test_prometheus.py"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _legend(template: str, labels: Mapping[str, str]) -> str:
    for name, value in labels.items():
        template = template.replace("{{" + name + "}}", value)
    return template
