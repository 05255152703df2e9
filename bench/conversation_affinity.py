"""Multi-turn conversations over two workers: how much of each turn's prompt the prefix cache
serves when the turn goes back to the worker that served the last one.

Starts a Redis, a control plane, ``--workers`` data-plane workers (stories260K by default, one
torch thread each) and a gateway, then runs ``--conversations`` conversations of ``--turns``
turns through the Responses API, concurrently, three ways, alternated round by round (A, B, C,
A, B, C...) with the load average recorded:

- ``replay``: each turn sends the whole conversation as input items (what the OpenAI Agents SDK
  does by default), no key: the gateway routes each turn to the least-lagging worker;
- ``cache_key``: the same, with ``prompt_cache_key`` set to the conversation's id (rendezvous
  hashing sends every turn of a conversation to one worker, in every gateway);
- ``previous``: each turn sends only its new message with ``previous_response_id``: the
  gateway rebuilds the conversation from Redis and prefers the worker that served the last turn.

Measured per way: the share of prompt tokens the prefix cache served (``usage``'s
``cached_tokens`` over ``input_tokens``, after the first turn) and the time to the response.
Ends with ``RESULT conversation_affinity cached_share_replay=... cached_share_cache_key=...
cached_share_previous=...``.

    .venv/bin/python bench/conversation_affinity.py [--rounds 2] [--conversations 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared/models/stories260K"
WAYS = ("replay", "cache_key", "previous")
WORDS = ("Lily", "Tom", "went", "to", "the", "park", "and", "saw", "a", "big", "red", "ball")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(STORIES / "stories260K.bin"))
    parser.add_argument("--tokenizer", default=str(STORIES / "tok512.bin"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-output-tokens", type=int, default=24)
    parser.add_argument("--port", type=int, default=8191)
    return parser.parse_args()


@contextmanager
def system(args: argparse.Namespace, workdir: Path) -> Iterator[str]:
    """Redis, a control plane, the workers and a gateway; yields the gateway's URL."""
    redis_port = args.port + 1
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    env = {**os.environ, "SUPERINFER_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1",
           "SUPERINFER_ADMIN_TOKEN": "affinity-bench-admin"}  # fmt: skip
    cli = [sys.executable, "-m", "superinfer"]
    model = ["--model", args.model, "--tokenizer", args.tokenizer]
    one_thread = ["--threads", "1"]
    workers = [
        [*cli, "data-plane", "--worker-id", f"w{i}", *model, *one_thread, "--health-port", port]
        for i, port in enumerate(str(args.port + 3 + i) for i in range(args.workers))
    ]
    commands = [
        ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
        [*cli, "control-plane", "--health-port", str(args.port + 2)],
        *workers,
        [*cli, "gateway", "--port", str(args.port), *model],
    ]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for index, command in enumerate(commands):
            log = (workdir / f"process{index}.log").open("wb")
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=log, cwd=ROOT))
            if index == 0:
                time.sleep(0.5)
        url = f"http://127.0.0.1:{args.port}"
        wait_ready(url, args.workers)
        yield url
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def wait_ready(url: str, num_workers: int, timeout_s: float = 180.0) -> None:
    headers = {"Authorization": "Bearer affinity-bench-admin"}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            workers = httpx.get(f"{url}/admin/v1/workers", headers=headers, timeout=2).json()
            if len(workers.get("workers", [])) >= num_workers:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{num_workers} workers not ready at {url} within {timeout_s} s")


async def conversation(
    client: httpx.AsyncClient, way: str, index: int, args: argparse.Namespace
) -> list[tuple[int, int, float]]:
    """(input tokens, cached tokens, seconds) of each turn after the first."""
    key = f"conv-{uuid.uuid4().hex}"
    items: list[Any] = []
    previous: str | None = None
    measured = []
    for turn in range(args.turns):
        text = " ".join(WORDS[(index + turn + i) % len(WORDS)] for i in range(6))
        # the conversation's own id first: no run finds another run's turns in the cache
        message = {"role": "user", "content": f"{key[5:17]} {text} ({index}.{turn})"}
        body: dict[str, Any] = {"max_output_tokens": args.max_output_tokens, "temperature": 0}
        if way == "previous":
            body |= {"input": [message], "previous_response_id": previous}
        else:
            body["input"] = [*items, message]
            if way == "cache_key":
                body["prompt_cache_key"] = key
        t0 = time.perf_counter()
        response = await client.post("/v1/responses", json=body)
        elapsed = time.perf_counter() - t0
        response.raise_for_status()
        reply = response.json()
        previous = reply["id"]
        items += [message, *reply["output"]]
        usage = reply["usage"]
        if turn > 0:
            cached = usage["input_tokens_details"]["cached_tokens"]
            measured.append((usage["input_tokens"], cached, elapsed))
    return measured


async def run_way(url: str, way: str, args: argparse.Namespace) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        turns = await asyncio.gather(
            *(conversation(client, way, i, args) for i in range(args.conversations))
        )
    flat = [t for conv in turns for t in conv]
    return {
        "cached_share": sum(c for _, c, _ in flat) / max(1, sum(n for n, _, _ in flat)),
        "seconds_p50": statistics.median(s for _, _, s in flat),
    }


def main() -> None:
    args = parse_args()
    results: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp, system(args, Path(tmp)) as url:
        for round_index in range(args.rounds):
            for way in WAYS:
                load = os.getloadavg()[0]
                result = asyncio.run(run_way(url, way, args))
                results[way].append(result)
                print(
                    f"round {round_index} {way:9s} cached share {result['cached_share']:.3f} "
                    f"turn p50 {result['seconds_p50'] * 1e3:.0f} ms  load {load:.2f}",
                    flush=True,
                )
    shares = {way: statistics.mean(r["cached_share"] for r in rs) for way, rs in results.items()}
    p50s = {way: statistics.median(r["seconds_p50"] for r in rs) for way, rs in results.items()}
    fields = " ".join(f"cached_share_{way}={shares[way]:.3f}" for way in WAYS)
    fields += " " + " ".join(f"turn_p50_ms_{way}={p50s[way] * 1e3:.0f}" for way in WAYS)
    print(f"RESULT conversation_affinity workers={args.workers} {fields}")


if __name__ == "__main__":
    main()
