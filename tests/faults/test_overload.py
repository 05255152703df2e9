"""Overload and slow readers: excess load gets 429 + Retry-After, accepted requests complete,
and memory stays within a stated bound (measured RSS)."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import httpx

from tests.faults.support import System, run_load, summary

# The overload lasts this long (the full run: SUPERINFER_OVERLOAD_S=60).
OVERLOAD_S = float(os.environ.get("SUPERINFER_OVERLOAD_S", "12"))
GATEWAY_RSS_BOUND_MB = 400.0
WORKER_RSS_GROWTH_BOUND_MB = 100.0


async def _blast(url: str, duration_s: float, concurrency: int) -> tuple[int, int, int]:
    """Back-to-back requests from ``concurrency`` clients for ``duration_s``: (accepted and
    completed, rejected with 429 + Retry-After, anything else)."""
    counts = [0, 0, 0]
    body = {"prompt": "Once upon", "max_tokens": 16, "ignore_eos": True}
    deadline = time.monotonic() + duration_s
    # A fresh connection per request: reusing a kept-alive one races the server closing it
    # (a client-side ReadError that says nothing about the server).
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def client_loop() -> None:
            while time.monotonic() < deadline:
                response = await client.post("/v1/completions", json=body)
                if response.status_code == 200:
                    counts[0] += response.json()["usage"]["completion_tokens"] == 16
                elif response.status_code == 429 and int(response.headers["retry-after"]) >= 1:
                    counts[1] += 1
                    await asyncio.sleep(0.05)
                else:
                    counts[2] += 1

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return counts[0], counts[1], counts[2]


async def test_r7_overload_gets_429_and_memory_stays_bounded(system: System) -> None:
    # Capacity: the worker runs 16 sequences and this gateway queues 8 more; 240 clients
    # (10x what it can hold) send back to back.
    rss_start = {name: system.rss_mb(name) for name in ("gateway", "w0")}
    num_ok, num_429, num_other = await _blast(system.url, OVERLOAD_S, 240)
    rss_end = {name: system.rss_mb(name) for name in ("gateway", "w0")}
    print(
        f"R7: {OVERLOAD_S:.0f} s at 240 clients: {num_ok} completed, {num_429} got 429, "
        f"{num_other} other; RSS MB gateway {rss_start['gateway']:.0f} -> "
        f"{rss_end['gateway']:.0f}, worker {rss_start['w0']:.0f} -> {rss_end['w0']:.0f}"
    )
    assert num_ok > 0 and num_429 > 0 and num_other == 0
    assert rss_end["gateway"] < GATEWAY_RSS_BOUND_MB
    assert rss_end["w0"] - rss_start["w0"] < WORKER_RSS_GROWTH_BOUND_MB


def _slow_reader(port: int) -> socket.socket:
    """A client that asks for a long stream and then reads nothing (a tiny receive buffer,
    so the server's writes back up at once)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", port))
    body = b'{"prompt": "Once", "max_tokens": 2000, "ignore_eos": true, "stream": true}'
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


async def test_slow_reader_neither_slows_others_nor_grows_memory(system: System) -> None:
    t_start = time.monotonic()
    baseline = await run_load(system.url, 16, 8, 64)
    baseline_s = time.monotonic() - t_start
    readers = [_slow_reader(system.port) for _ in range(4)]
    rss_before = system.rss_mb("gateway")
    t_start = time.monotonic()
    for _ in range(6):  # read one byte a second from each, for a while
        for sock in readers:
            sock.recv(1)
        await asyncio.sleep(0.2)
    outcomes = await run_load(system.url, 16, 8, 64)
    with_slow_s = time.monotonic() - t_start - 1.2
    rss_after = system.rss_mb("gateway")
    for sock in readers:
        sock.close()
    print(
        f"slow readers: {summary(outcomes)}; 16 streams took {with_slow_s:.1f} s beside 4 "
        f"stalled readers vs {baseline_s:.1f} s alone; gateway RSS {rss_before:.0f} -> "
        f"{rss_after:.0f} MB"
    )
    assert all(o.completed for o in outcomes + baseline)
    assert with_slow_s < 3 * baseline_s + 2.0
    assert rss_after - rss_before < 50.0
