"""The HTTP edge (gateway/edge.py) on a running system: an oversized head is refused at once
while another client's stream goes on; connections that send nothing, or dribble a head, are
closed by the header timeout without delaying /health or a chat; the connection cap and the body
and keep-alive timeouts (an in-process server); the heartbeat goes on while the event loop is
blocked (threats 12 and 13 in docs/threats.md)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import selectors
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import uvicorn
from redis.asyncio import Redis

from gateway.main import server_config
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from shared import streams
from tests.redis_support import redis_url
from tests.served import Served, free_port, gateway

HEADER_TIMEOUT_S = 2.0
SLACK_S = 1.0  # a busy 2-core host
MODEL = "stories260K"
STREAM = {"model": MODEL, "prompt": "Once", "max_tokens": 48, "ignore_eos": True, "stream": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Once"}], "max_tokens": 16}


@pytest.fixture(scope="module")
def edge_url(served: Served, stories_path: Path) -> Iterator[str]:
    """A second gateway on the served system, its header timeout HEADER_TIMEOUT_S."""
    env = {"SUPERINFER_HTTP_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)}
    with gateway(served.redis_url, str(stories_path), env) as url:
        yield url


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _raw(port: int, data: bytes) -> tuple[bytes, float]:
    """Send ``data`` while reading: the response's first line, and the seconds until it came."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        started = time.monotonic()
        reply: list[tuple[bytes, float]] = []

        def read() -> None:
            with contextlib.suppress(OSError):
                reply.append((sock.recv(65536).split(b"\r\n")[0], time.monotonic() - started))

        reader = threading.Thread(target=read)
        reader.start()
        with contextlib.suppress(OSError):  # the server may close once it has answered
            sock.sendall(data)
        reader.join(10)
    return reply[0] if reply else (b"", float("inf"))


def _stream(url: str, times: list[float], events: list[str]) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=STREAM, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
                events.append(line[6:])


def _wait(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.01)


def test_a_32_mb_header_is_refused_within_a_second_while_a_stream_finishes(edge_url: str) -> None:
    head = b"GET /health HTTP/1.1\r\nhost: gw\r\nx-big: " + b"a" * (32 << 20) + b"\r\n\r\n"
    times: list[float] = []
    events: list[str] = []
    streamer = threading.Thread(target=_stream, args=(edge_url, times, events))
    streamer.start()
    _wait(lambda: len(times) >= 3)
    status, refused_s = _raw(_port(edge_url), head)
    refused_at = time.monotonic()
    streamer.join(60)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    print(f"32 MB header: {status!r} after {refused_s * 1000:.0f} ms; stream: {len(times)} ")
    print(f"events, slowest gap {max(gaps) * 1000:.0f} ms")
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large" and refused_s < 1.0
    assert events[-1] == "[DONE]" and times[-1] > refused_at  # it streamed on after
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert max(gaps) < 1.0


def test_each_head_limit_has_its_status(edge_url: str) -> None:
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(200))
    heads = {
        b"GET /health HTTP/1.1\r\nhost: gw\r\n\r\n": 200,
        b"GET /" + b"a" * 40_000: 414,  # a request line over the head limit
        b"GET /health?" + b"a" * 9000 + b" HTTP/1.1\r\nhost: gw\r\n\r\n": 414,  # URL limit
        b"GET /health HTTP/1.1\r\nhost: gw\r\n" + many + b"\r\n": 431,  # header count
        b"GET /health HTTP/1.1\r\nhost: gw\r\nx-a: " + b"a" * 40_000 + b"\r\n\r\n": 431,
        b"NOT HTTP AT ALL\r\n\r\n": 400,
    }
    for head, status in heads.items():
        line, _ = _raw(_port(edge_url), head)
        assert line.startswith(b"HTTP/1.1 %d " % status), (head[:40], line)


def _closed_after(socks: dict[socket.socket, float], timeout_s: float) -> dict[int, float]:
    """Watch the sockets until the server closed each: seconds from its start to its close
    (by socket number); what a socket received before its close is dropped."""
    closed: dict[int, float] = {}
    with selectors.DefaultSelector() as selector:
        for opened in socks:
            selector.register(opened, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while len(closed) < len(socks) and time.monotonic() < deadline:
            for key, _ in selector.select(0.05):
                sock: Any = key.fileobj
                try:
                    ended = not sock.recv(65536)
                except OSError:
                    ended = True
                if ended:
                    closed[sock.fileno()] = time.monotonic() - socks[sock]
                    selector.unregister(sock)
    return closed


def test_500_idle_connections_are_closed_within_the_header_timeout(edge_url: str) -> None:
    socks = {}
    for _ in range(500):
        sock = socket.create_connection(("127.0.0.1", _port(edge_url)))
        socks[sock] = time.monotonic()
    try:
        closed = _closed_after(socks, HEADER_TIMEOUT_S + 10)
        assert httpx.get(f"{edge_url}/health", timeout=5).status_code == 200
    finally:
        for sock in socks:
            sock.close()
    print(f"500 idle: {len(closed)} closed, after {min(closed.values()):.2f}-")
    print(f"{max(closed.values()):.2f} s (header timeout {HEADER_TIMEOUT_S} s)")
    assert len(closed) == 500 and max(closed.values()) < HEADER_TIMEOUT_S + SLACK_S


class _Slowloris(threading.Thread):
    """``count`` connections, each sending a head one byte every ``every_s`` and never ending
    it; one closed by the server is replaced until :meth:`stop`."""

    def __init__(self, port: int, count: int, every_s: float = 0.25) -> None:
        super().__init__()
        self.port, self.count, self.every_s = port, count, every_s
        self.closed_s: list[float] = []  # connection to close, of those the server closed
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()
        self.join(30)

    def _open(self, selector: selectors.BaseSelector) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: gw\r\nx-loris: ")
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, time.monotonic())

    def run(self) -> None:
        with selectors.DefaultSelector() as selector:
            for _ in range(self.count):
                self._open(selector)
            while not self._stopping.is_set():
                for key in list(selector.get_map().values()):
                    with contextlib.suppress(OSError):
                        key.fileobj.send(b"a")  # type: ignore[union-attr]
                for key, _ in selector.select(self.every_s):
                    with contextlib.suppress(OSError):
                        if key.fileobj.recv(65536):  # type: ignore[union-attr]
                            continue  # a 408 before the close
                    self.closed_s.append(time.monotonic() - key.data)
                    selector.unregister(key.fileobj)
                    key.fileobj.close()  # type: ignore[union-attr]
                    self._open(selector)
            for key in list(selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]


def _latencies(call: Callable[[], httpx.Response], count: int) -> list[float]:
    latencies = []
    for _ in range(count):
        started = time.monotonic()
        response = call()
        assert response.status_code == 200, response.text[:300]
        latencies.append(time.monotonic() - started)
        time.sleep(0.05)
    return latencies


def test_slowloris_delays_neither_health_nor_a_chat(edge_url: str) -> None:
    with httpx.Client(base_url=edge_url, timeout=10) as client:

        def health() -> httpx.Response:
            return client.get("/health")

        def chat() -> httpx.Response:
            return client.post("/v1/chat/completions", json=CHAT)

        health_before, chat_before = _latencies(health, 10), _latencies(chat, 5)
        loris = _Slowloris(_port(edge_url), 200)
        loris.start()
        time.sleep(0.3)
        health_during, chat_during = _latencies(health, 10), _latencies(chat, 5)
        time.sleep(max(0.0, HEADER_TIMEOUT_S + SLACK_S - 0.3 - sum(health_during + chat_during)))
        loris.stop()
    base_health, base_chat = statistics.median(health_before), statistics.median(chat_before)
    health_delay = max(health_during) - base_health
    chat_delay = statistics.median(chat_during) - base_chat  # a chat alone varies by 0.5 s
    print(f"slowloris: {len(loris.closed_s)} closed (200 open), after up to ")
    print(f"{max(loris.closed_s):.2f} s; /health {base_health * 1000:.0f} ms, slowest ")
    print(f"{max(health_during) * 1000:.0f} ms with them; chat (median of 5) ")
    print(f"{base_chat * 1000:.0f} ms, {statistics.median(chat_during) * 1000:.0f} ms with them")
    assert len(loris.closed_s) >= 200 and max(loris.closed_s) < HEADER_TIMEOUT_S + SLACK_S
    assert health_delay < 0.5 and chat_delay < 0.5


class _HoldingApp:
    """/hold answers once released; anything else at once."""

    def __init__(self) -> None:
        self.holding = 0
        self.release = threading.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/hold":
            self.holding += 1
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


@contextlib.contextmanager
def _in_process(app: Any, **limits: Any) -> Iterator[int]:
    """The gateway's server (gateway.main.server_config) with ``limits`` around ``app``."""
    settings = GatewaySettings(port=free_port(), admin_disabled=True, **limits)
    server = uvicorn.Server(server_config(app, settings))
    thread = threading.Thread(target=server.run)
    thread.start()
    _wait(lambda: server.started, 10)
    try:
        yield settings.port
    finally:
        server.should_exit = True
        thread.join(10)


def _connect(port: int, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(data)
    return sock


def test_connection_cap_makes_room_then_refuses_clearly() -> None:
    """Six connections at most: a seventh closes the one waiting for a head; with all six
    serving requests, the next one gets 503 too_many_connections."""
    app = _HoldingApp()
    with _in_process(app, http_max_connections=6, http_header_timeout_s=30.0) as port:
        idle = _connect(port)
        hold = b"GET /hold HTTP/1.1\r\nhost: gw\r\n\r\n"
        holders = [_connect(port, hold) for _ in range(5)]
        _wait(lambda: app.holding == 5, 10)
        holders.append(_connect(port, hold))  # makes room: the idle one goes
        assert idle.recv(1024) == b""
        _wait(lambda: app.holding == 6, 10)
        refused = _connect(port)
        reply = refused.recv(65536)
        assert reply.startswith(b"HTTP/1.1 503 Service Unavailable")
        assert json.loads(reply.split(b"\r\n\r\n")[1])["error"]["code"] == "too_many_connections"
        app.release.set()
        for sock in holders:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")
        for sock in [idle, refused, *holders]:
            sock.close()


def test_body_and_keep_alive_timeouts() -> None:
    with _in_process(_HoldingApp(), http_body_timeout_s=0.5, http_keep_alive_s=0.5) as port:
        slow_body = b"POST / HTTP/1.1\r\nhost: gw\r\ncontent-length: 10\r\n\r\nabc"
        status, late_s = _raw(port, slow_body)
        assert status == b"HTTP/1.1 408 Request Timeout" and 0.4 < late_s < 0.5 + SLACK_S
        kept = _connect(port, b"GET / HTTP/1.1\r\nhost: gw\r\n\r\n")
        assert kept.recv(65536).startswith(b"HTTP/1.1 200 OK")
        answered = time.monotonic()
        assert kept.recv(1024) == b""  # closed by the keep-alive timeout
        assert 0.4 < time.monotonic() - answered < 0.5 + SLACK_S
        kept.close()


async def test_the_heartbeat_goes_on_while_the_event_loop_is_blocked(
    stories_path: Path, redis_client: Redis
) -> None:
    """A request that holds the event loop for 2 s (as a 96 MB header did) does not stop the
    gateway's heartbeat: no worker calls it dead (data_plane/orphans.py)."""
    url = redis_url()
    settings = GatewaySettings(
        redis_url=url, model=str(stories_path), admin_disabled=True, gateway_id="gw-e"
    )
    state = GatewayState(settings)
    await state.start()
    changes: list[float] = []
    done = threading.Event()

    def watch() -> None:
        client, last = redis.Redis.from_url(url), None
        while not done.wait(0.02):
            beat = client.hget(streams.GATEWAYS_KEY, "gw-e")
            if beat != last:
                changes.append(time.monotonic())
                last = beat
        client.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    await asyncio.sleep(0.5)
    time.sleep(2.0)  # the event loop blocked
    await asyncio.sleep(0.5)
    done.set()
    watcher.join()
    await state.close()
    gaps = [b - a for a, b in itertools.pairwise(changes)]
    print(f"heartbeat: {len(changes)} beats in 3 s, longest gap {max(gaps) * 1000:.0f} ms")
    assert len(changes) > 8 and max(gaps) < 1.0
