"""Overload and slow readers: excess load gets 429 + Retry-After, accepted requests complete,
a client that stops reading hits the gateway's output bound (an SSE overflow error, not
unbounded memory), and memory stays within a stated bound (measured RSS)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import httpx

from tests.faults.conftest import MakeSystem
from tests.faults.support import System, exact_tokens, run_load, summary, wait_for

# The overload lasts this long (the full run: SUPERINFER_OVERLOAD_S=60).
OVERLOAD_S = float(os.environ.get("SUPERINFER_OVERLOAD_S", "12"))
GATEWAY_RSS_BOUND_MB = 400.0
WORKER_RSS_GROWTH_BOUND_MB = 100.0


async def _blast(url: str, duration_s: float, concurrency: int) -> tuple[int, int, list[str]]:
    """Back-to-back requests from ``concurrency`` clients for ``duration_s``: (accepted and
    completed with all their tokens, rejected with 429 + Retry-After, anything else)."""
    num_ok, num_429, other = 0, 0, []
    body = {"prompt": "Once upon", "max_tokens": 16, "ignore_eos": True}
    deadline = time.monotonic() + duration_s
    # A fresh connection per request: reusing a kept-alive one races the server closing it
    # (a client-side ReadError that says nothing about the server).
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def client_loop() -> None:
            nonlocal num_ok, num_429
            while time.monotonic() < deadline:
                try:
                    response = await client.post("/v1/completions", json=body)
                except httpx.HTTPError as exc:  # a transport error is never fine
                    other.append(f"transport: {exc!r}")
                    continue
                if response.status_code == 200:
                    if response.json()["usage"]["completion_tokens"] == 16:
                        num_ok += 1
                    else:
                        other.append(f"200 with {response.json()['usage']} tokens")
                elif response.status_code == 429 and int(response.headers["retry-after"]) >= 1:
                    num_429 += 1
                    await asyncio.sleep(0.05)
                else:
                    other.append(f"{response.status_code}: {response.text[:200]}")

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return num_ok, num_429, other


async def test_r7_overload_gets_429_and_memory_stays_bounded(system: System) -> None:
    # Capacity: the worker runs 16 sequences and this gateway queues 8 more; 240 clients
    # (10x what it can hold) send back to back.
    rss_start = {name: system.rss_mb(name) for name in ("gateway", "w0")}
    num_ok, num_429, other = await _blast(system.url, OVERLOAD_S, 240)
    rss_end = {name: system.rss_mb(name) for name in ("gateway", "w0")}
    print(
        f"R7: {OVERLOAD_S:.0f} s at 240 clients: {num_ok} completed, {num_429} got 429, "
        f"{len(other)} other; RSS MB gateway {rss_start['gateway']:.0f} -> "
        f"{rss_end['gateway']:.0f}, worker {rss_start['w0']:.0f} -> {rss_end['w0']:.0f}"
    )
    assert num_ok > 0 and num_429 > 0 and not other, other[:5]
    assert rss_end["gateway"] < GATEWAY_RSS_BOUND_MB
    assert rss_end["w0"] - rss_start["w0"] < WORKER_RSS_GROWTH_BOUND_MB


# The gateway keeps at most this many outputs per request for a client that is behind
# (SUPERINFER_MAX_BUFFERED_OUTPUTS; 4096 by default, small here so that a stalled reader
# reaches it soon). Ahead of that queue sit the event loop's write buffer (64 KiB) and the
# sockets' (small, see _slow_reader); a long served model name, repeated in every chunk, makes
# chunks of about 4 KiB, so those buffers fill within about 25 chunks. Most of tiny-random's
# tokens decode to no text (no chunk, about 1 in 4 does): about 100 tokens fit before the
# bound (25 chunks, then 16 queued outputs), and 300 are asked for.
SLOW_READER_MAX_BUFFERED = 16
SLOW_READER_MODEL_NAME = "tiny-random-" + "x" * 4096
SLOW_READER_MAX_TOKENS = 300
NUM_SLOW_READERS = 4


def _slow_reader(port: int) -> socket.socket:
    """A client that asks for a long stream and then reads nothing (a tiny receive buffer,
    so the server's writes back up at once)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    # Small segments: the server's send buffer grows with its congestion window times the
    # segment size, and loopback's 64 KiB segments would let it hold megabytes.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", port))
    body = json.dumps(
        {"prompt": "Once", "max_tokens": SLOW_READER_MAX_TOKENS, "ignore_eos": True, "stream": True}
    ).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def _read_to_end(sock: socket.socket) -> str:
    """Everything the server sends until it ends the response (the chunked body's last
    chunk) or closes the connection."""
    sock.settimeout(120)
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace")


def _sse_data(raw: str) -> list[str]:
    return [line[6:] for line in raw.splitlines() if line.startswith("data: ")]


def _sse_errors(raw: str) -> list[dict[str, str]]:
    return [json.loads(d)["error"] for d in _sse_data(raw) if d.startswith('{"error"')]


async def test_slow_reader_overflows_without_slowing_others_or_growing_memory(
    make_system: MakeSystem,
) -> None:
    system = make_system(
        {
            "SUPERINFER_MAX_BUFFERED_OUTPUTS": str(SLOW_READER_MAX_BUFFERED),
            "SUPERINFER_SERVED_MODEL_NAME": SLOW_READER_MODEL_NAME,
        }
    )
    t_start = time.monotonic()
    baseline = await run_load(system.url, 8, 8, 32)
    baseline_s = time.monotonic() - t_start
    rss_before = system.rss_mb("gateway")
    readers = [_slow_reader(system.port) for _ in range(NUM_SLOW_READERS)]
    # Each reader's request runs until the gateway's bound overflows, then the gateway aborts it
    # on the worker (its log says so; a heartbeat may never catch them running: on a fast host
    # they overflow within one interval). The readers' responses stay blocked writing.
    await wait_for(
        lambda: len(system.events("w0", "request_aborted")) >= NUM_SLOW_READERS,
        "the readers' requests overflowed and were aborted",
    )
    t_start = time.monotonic()
    outcomes = await run_load(system.url, 8, 8, 32)
    with_slow_s = time.monotonic() - t_start
    await wait_for(
        lambda: system.worker("w0")["num_running"] + system.worker("w0")["num_waiting"] == 0,
        "the worker finished the readers' requests",
    )
    rss_after = system.rss_mb("gateway")
    streams = [await asyncio.to_thread(_read_to_end, sock) for sock in readers]
    for sock in readers:
        sock.close()
    errors = [_sse_errors(raw) for raw in streams]
    num_text_chunks = [raw.count('"text":') for raw in streams]
    print(
        f"slow readers: {summary(outcomes)}; 8 streams took {with_slow_s:.1f} s beside "
        f"{NUM_SLOW_READERS} stalled readers vs {baseline_s:.1f} s alone; gateway RSS "
        f"{rss_before:.0f} -> {rss_after:.0f} MB; the readers got {num_text_chunks} chunks, then "
        f"{[e[0]['code'] if e else None for e in errors]}"
    )
    assert all(o.completed for o in outcomes + baseline), summary(outcomes + baseline)
    assert not exact_tokens(outcomes + baseline, 32)
    # Each stalled reader hit the bound: its stream (a 200) ends with the overflow error event,
    # then [DONE]; no finish reason came before it.
    for raw, found in zip(streams, errors, strict=True):
        assert raw.startswith("HTTP/1.1 200"), raw[:200]
        assert [e["code"] for e in found] == ["overflow"], found
        data = _sse_data(raw)
        assert data[-1] == "[DONE]" and data[-2].startswith('{"error"'), data[-3:]
        assert '"finish_reason":"length"' not in raw.replace(" ", "")
    # Others are served beside them: not stuck behind the stalled writes (a loose bound: the
    # readers' requests share the batch, and on CI's busy cores the two timings vary a lot),
    # and the gateway buffered nothing beyond its bound.
    assert with_slow_s < 5 * baseline_s + 30.0
    assert rss_after - rss_before < 50.0
