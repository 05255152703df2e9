"""Deadlines and admission on the default CPU setup (issue 30): `superinfer serve` with its
defaults (SmolLM2-135M-Instruct's GGUF, every setting at its default) takes 300 concurrent
streams (40-word prompts, 8 tokens each): every admitted one must complete, the rest get 429
at once; then one 7,950-token prompt must complete or be refused at admission, never 504.
``tests/gateway/test_deadlines.py`` checks the same on a scaled setup in CI; this is the run
at full size (minutes on 2 cores).

    .venv/bin/python bench/deadlines_default.py [--streams 300] [--long-tokens 7950]

Last line: ``RESULT deadlines_default admitted=... completed=... refused=... failed=...
slowest_refusal_s=... long_status=... long_s=... load_avg=...`` (failed: admitted and not
completed; the bench exits 1 when any failed or the long prompt got a 504)."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import string
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gateway.test_deadlines import _Result, _stream  # noqa: E402
from tests.served import embedded_redis, serve  # noqa: E402


def _words(num: int) -> str:
    return " ".join("".join(random.choices(string.ascii_lowercase, k=5)) for _ in range(num))


async def _burst(url: str, num_streams: int) -> list[_Result]:
    limits = httpx.Limits(max_connections=num_streams + 10)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        return list(
            await asyncio.gather(*(_stream(client, _words(40), 8) for _ in range(num_streams)))
        )


async def _long(url: str, num_tokens: int) -> _Result:
    body = {"prompt": _words(num_tokens // 2)}
    ids = httpx.post(f"{url}/tokenize", json=body, timeout=120).json()["tokens"][:num_tokens]
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        return await _stream(client, ids, 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--long-tokens", type=int, default=7950)
    args = parser.parse_args(argv)
    with embedded_redis() as redis_url, serve([], redis_url, {}) as system:
        httpx.post(f"{system.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4},
                   timeout=120)  # fmt: skip
        time.sleep(2)  # a heartbeat brings the measured rate to the gateway
        t_start = time.monotonic()
        outcomes = asyncio.run(_burst(system.url, args.streams))
        burst_s = time.monotonic() - t_start
        long_one = asyncio.run(_long(system.url, args.long_tokens))
    admitted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    completed = [o for o in admitted if o.completed and o.num_tokens == 8]
    slowest = max((o.elapsed_s for o in refused), default=0.0)
    load = os.getloadavg()[0]
    print(
        f"{args.streams} streams: {len(admitted)} admitted, {len(completed)} completed, "
        f"{len(refused)} got 429 (slowest {slowest:.2f} s), done in {burst_s:.0f} s"
    )
    print(
        f"{args.long_tokens}-token prompt: {long_one.status} {long_one.code or ''} "
        f"completed={long_one.completed} in {long_one.elapsed_s:.0f} s"
    )
    failed = len(admitted) - len(completed)
    print(
        f"RESULT deadlines_default admitted={len(admitted)} completed={len(completed)} "
        f"refused={len(refused)} failed={failed} slowest_refusal_s={slowest:.2f} "
        f"long_status={long_one.status} long_s={long_one.elapsed_s:.0f} load_avg={load:.2f}"
    )
    long_ok = long_one.completed or long_one.status in (400, 429)
    return 0 if failed == 0 and long_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
