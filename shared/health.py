"""The small HTTP endpoint that probes and Prometheus need, for the worker and the control plane.

- ``GET /health``: 200 while the event loop runs (a blocked loop does not answer: liveness).
- ``GET /ready``: 200 when the service's readiness check says so, else 503.
- ``GET /metrics``: the Prometheus text format of the registry the service passes in.

``HEAD`` works on each; anything else is 404 (or 405 for another method). One request per
connection (``Connection: close``); a plain ``asyncio.start_server``, no web framework.

``python -m shared.health [PORT]`` probes ``/health`` on 127.0.0.1 and exits 0 or 1: the
container health check. The port defaults to ``SUPERINFER_HEALTH_PORT`` (worker, control
plane), then ``SUPERINFER_PORT`` (gateway), then 8000.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from redis.asyncio import Redis

log = structlog.get_logger(__name__)

ReadyCheck = Callable[[], Awaitable[bool]]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}
_MAX_HEADER_LINES = 64
_TEXT = "text/plain; charset=utf-8"


class HealthServer:
    """``/health``, ``/ready`` and ``/metrics`` on ``host:port`` (port 0: any free port)."""

    def __init__(
        self,
        ready: ReadyCheck,
        registry: CollectorRegistry | None = None,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        ready_timeout_s: float = 2.0,
        read_timeout_s: float = 5.0,
    ) -> None:
        self.ready = ready
        self.registry = registry if registry is not None else CollectorRegistry()
        self.host = host
        self.requested_port = port
        self.ready_timeout_s = ready_timeout_s
        self.read_timeout_s = read_timeout_s
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The bound port (useful when started with port 0)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the health server is not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, self.host, self.requested_port, limit=16384
        )
        log.info("health_server_started", host=self.host, port=self.port)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        await self._server.wait_closed()
        self._server = None
        log.info("health_server_stopped")

    async def __aenter__(self) -> HealthServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def is_ready(self) -> bool:
        """The readiness check; an exception or a time-out counts as not ready."""
        try:
            return bool(await asyncio.wait_for(self.ready(), self.ready_timeout_s))
        except Exception as exc:  # a probe must answer, whatever the check raised
            log.debug("readiness_check_failed", error=repr(exc))
            return False

    async def respond(self, method: str, path: str) -> tuple[int, str, bytes]:
        """Status, content type and body for one request."""
        if path not in ("/health", "/ready", "/metrics"):
            return 404, _TEXT, b"not found\n"
        if method not in ("GET", "HEAD"):
            return 405, _TEXT, b"method not allowed\n"
        if path == "/health":
            return 200, _TEXT, b"ok\n"
        if path == "/ready":
            if await self.is_ready():
                return 200, _TEXT, b"ready\n"
            return 503, _TEXT, b"not ready\n"
        return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path = await asyncio.wait_for(self._read_request(reader), self.read_timeout_s)
            if method:
                status, content_type, body = await self.respond(method, path)
            else:
                status, content_type, body = 400, _TEXT, b"bad request\n"
            head = (
                f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
                f"Content-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            ).encode("latin-1")
            writer.write(head if method == "HEAD" else head + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # the client went away, never sent a request, or sent an over-long line
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await writer.wait_closed()

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
        """(method, path) of the request line, or ("", "") if it is malformed; reads the
        headers too (ignored: no body is expected)."""
        request_line = (await reader.readline()).decode("latin-1").strip()
        for _ in range(_MAX_HEADER_LINES):
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
        parts = request_line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return "", ""
        return parts[0].upper(), parts[1].split("?", 1)[0]


@contextlib.asynccontextmanager
async def serve_health(
    port: int | None,
    ready: ReadyCheck,
    registry: CollectorRegistry | None = None,
    host: str = "0.0.0.0",
) -> AsyncIterator[HealthServer | None]:
    """A started :class:`HealthServer` for the block, closed after it; nothing when ``port``
    is None or 0 (the endpoint is off)."""
    if not port:
        yield None
        return
    server = HealthServer(ready, registry, host=host, port=port)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


async def redis_reachable(redis: Redis, timeout_s: float = 1.0) -> bool:
    """Whether Redis answers PING within ``timeout_s``."""
    try:
        return bool(await asyncio.wait_for(redis.ping(), timeout_s))
    except Exception:  # any failure (refused, time-out, auth) means not reachable
        return False


def probe(port: int, path: str = "/health", timeout_s: float = 3.0) -> bool:
    """Whether ``GET http://127.0.0.1:PORT/PATH`` answers 200."""
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def probe_port(argv: Sequence[str], environ: dict[str, str] | os._Environ[str]) -> int:
    if argv:
        return int(argv[0])
    for name in ("SUPERINFER_HEALTH_PORT", "SUPERINFER_PORT"):
        value = environ.get(name, "").strip()
        if value and value != "0":
            return int(value)
    return 8000


def main(argv: Sequence[str] | None = None) -> int:
    port = probe_port(sys.argv[1:] if argv is None else argv, os.environ)
    healthy = probe(port)
    print(f"127.0.0.1:{port}/health: {'ok' if healthy else 'unhealthy'}")
    return 0 if healthy else 1


if __name__ == "__main__":
    raise SystemExit(main())
