"""/ready means "can serve": Redis reachable and a live worker. A control plane that is down (or
was never started) is a warning in the body, not a failure: the workers plan locally, and a
gateway that left its Service would turn away traffic they can serve."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.served import embedded_redis, free_port, gateway


@pytest.fixture
def worker_without_control_plane(stories_path: Path) -> Iterator[tuple[str, str]]:
    """(redis url, model): a private Redis with one stories260K worker and no control plane."""
    with embedded_redis() as redis_url:
        command = [sys.executable, "-m", "superinfer", "data-plane", "--worker-id", "solo-w0"]
        command += ["--redis-url", redis_url, "--model", str(stories_path)]
        command += ["--block-size", "4", "--max-num-seqs", "4", "--health-port", str(free_port())]
        process = subprocess.Popen(
            command, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            yield redis_url, str(stories_path)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_a_gateway_is_ready_with_no_control_plane(
    worker_without_control_plane: tuple[str, str],
) -> None:
    redis_url, model = worker_without_control_plane
    mistyped = {"SUPERINFER_DEFAULT_SLO_CLASS": "standrad"}
    with gateway(redis_url, model, mistyped) as url:  # waits for /ready: 200
        ready = httpx.get(f"{url}/ready", timeout=10)
        assert ready.status_code == 200
        body = ready.json()
        assert body["ready"] is True and body["problems"] == []
        assert any("control plane" in warning for warning in body["warnings"]), body
        # a default class that is not one: said, and served in the loosest (was the first)
        assert any("'standrad' is not an SLO class" in w for w in body["warnings"]), body
        body = {"prompt": "Once", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4  # planned by the worker
