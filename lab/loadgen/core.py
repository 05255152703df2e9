"""`superinfer bench`: an SLO load generator for any OpenAI-compatible endpoint.

A trace (the same readers as ``superinfer simulate``: ``lab.traces.load_trace``) becomes a
list of :class:`PlannedRequest` (``lab.loadgen.prompts``: arrival, prompt text of the
trace's input length in the served model's tokenizer, ``max_tokens`` = its output length, an SLO
class); :func:`run_requests` replays it with httpx over SSE (``ignore_eos`` so outputs have the
trace's length) and records what the client saw of every request (:class:`RequestRecord`).
``lab.loadgen.report`` turns the records into result rows, tables and plots;
``lab.loadgen.cli`` is the command (flags, server discovery, progress, outputs).

Times: every record's times are seconds from the run's start on this process's monotonic clock.
TTFT counts from the moment the request is sent (after any ``--max-concurrency`` wait, as
``vllm bench serve`` does); an SSE event with text or a finish reason is an output event (the
client's view of a token). How late the client itself dispatched each request is recorded
(``dispatched_s - scheduled_s``), and so is the event loop's own lag, so that a client that
became the bottleneck shows.

Imports only ``shared`` and httpx, so it runs against any server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
LOOP_PROBE_S = 0.01  # the event-loop lag probe sleeps this long and records the overshoot


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What ``GET /v1/models`` says of the served model."""

    model: str
    max_model_len: int | None = None
    root: str | None = None


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    arrival_s: float  # from the run's start
    input_len: int  # prompt tokens aimed at (the chat template adds its own)
    output_len: int  # max_tokens
    slo_class: str | None  # sent as x-slo-class; None: no header
    prompt: str


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it (seconds from the run's start)."""

    index: int
    slo_class: str | None
    scheduled_s: float
    input_len: int
    output_len: int
    dispatched_s: float = 0.0  # when the client got to it (before a concurrency wait)
    sent_s: float = 0.0
    end_s: float = 0.0
    event_times_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None  # the server's usage, when it reports one
    completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        """Usage's completion tokens, else the output events seen."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.event_times_s)


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # start to the last response's end
    loop_lag_s: list[float]


# ---- the client ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClientSettings:
    base_url: str  # http://host:port (a trailing /v1 is accepted)
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    ignore_eos: bool = True
    max_concurrency: int | None = None
    timeout_s: float = 600.0

    @property
    def root_url(self) -> str:
        return normalize_base_url(self.base_url)


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def request_body(settings: ClientSettings, planned: PlannedRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": settings.model,
        "max_tokens": planned.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.ignore_eos:
        body["ignore_eos"] = True
    if settings.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": planned.prompt}]
    else:
        body["prompt"] = planned.prompt
    return body


def request_headers(settings: ClientSettings, planned: PlannedRequest) -> dict[str, str]:
    headers = {}
    if settings.api_key:
        headers["authorization"] = f"Bearer {settings.api_key}"
    if planned.slo_class is not None:
        headers["x-slo-class"] = planned.slo_class
    return headers


def apply_event(record: RequestRecord, data: str, now_s: float, endpoint: str) -> bool:
    """Fold one SSE ``data:`` payload into ``record``; False once the stream is over."""
    if data == "[DONE]":
        return False
    chunk = json.loads(data)
    if "error" in chunk:
        error = chunk["error"]
        record.error = str(error.get("message", error) if isinstance(error, dict) else error)
        return False
    usage = chunk.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")
    for choice in chunk.get("choices") or []:
        if endpoint == "chat":
            text = (choice.get("delta") or {}).get("content")
        else:
            text = choice.get("text")
        finish = choice.get("finish_reason")
        if text or finish:
            record.event_times_s.append(now_s)
        if finish:
            record.finish_reason = str(finish)
    return True


async def send_one(
    client: httpx.AsyncClient,
    settings: ClientSettings,
    planned: PlannedRequest,
    record: RequestRecord,
    clock: Callable[[], float],
) -> None:
    """POST ``planned`` and read its SSE stream into ``record`` (errors end up in it; a
    request not done within ``timeout_s`` of being sent is one)."""
    url = settings.root_url + ENDPOINT_PATHS[settings.endpoint]
    body, headers = request_body(settings, planned), request_headers(settings, planned)
    record.sent_s = clock()
    try:
        async with (
            asyncio.timeout(settings.timeout_s),
            client.stream("POST", url, json=body, headers=headers) as response,
        ):
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return
            async for line in response.aiter_lines():
                if line.startswith("data:") and not apply_event(
                    record, line[5:].strip(), clock(), settings.endpoint
                ):
                    break
        if record.error is None and record.finish_reason is None:
            record.error = "the stream ended without a finish reason"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    except TimeoutError:
        record.error = f"not done within --timeout {settings.timeout_s:g} s"
    finally:
        record.end_s = clock()


async def _probe_loop_lag(lags_s: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(LOOP_PROBE_S)
        lags_s.append(max(0.0, time.perf_counter() - t0 - LOOP_PROBE_S))


async def run_requests(
    settings: ClientSettings,
    planned: Sequence[PlannedRequest],
    on_done: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    """Send every request at its arrival time; wait for all of them."""
    limit = settings.max_concurrency
    gate = asyncio.Semaphore(limit) if limit else None
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit or 256)
    timeout = httpx.Timeout(settings.timeout_s, connect=30.0)
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()  # after the client's set-up, which takes a while

        def clock() -> float:
            return time.perf_counter() - start

        async def one(request: PlannedRequest, record: RequestRecord) -> None:
            record.dispatched_s = clock()
            if gate is None:
                await send_one(client, settings, request, record, clock)
            else:
                async with gate:
                    await send_one(client, settings, request, record, clock)
            if on_done is not None:
                on_done(record)

        lags_s: list[float] = []
        stop = asyncio.Event()
        probe = asyncio.create_task(_probe_loop_lag(lags_s, stop))
        tasks = []
        for request in planned:
            delay_s = request.arrival_s - clock()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            record = RequestRecord(
                request.index, request.slo_class, request.arrival_s, request.input_len,
                request.output_len,
            )  # fmt: skip
            records.append(record)
            tasks.append(asyncio.create_task(one(request, record)))
        await asyncio.gather(*tasks)
        stop.set()
        await probe
        duration_s = max((r.end_s for r in records), default=clock())
    return RunResult(records, duration_s, lags_s)


async def fetch_server_info(base_url: str, api_key: str | None = None) -> ServerInfo:
    """The first model of ``GET /v1/models``."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.get(normalize_base_url(base_url) + "/v1/models", headers=headers)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model")
    first = models[0]
    max_len = first.get("max_model_len")
    return ServerInfo(str(first["id"]), int(max_len) if max_len else None, first.get("root"))
