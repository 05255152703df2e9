"""What publishing one iteration's token outputs costs the worker's event loop: one XADD per
request (the protocol before schema_version 4, rebuilt here as the baseline) against one
``TokenOutputs`` batch per reply stream (what ``data_plane.service.Worker`` sends), over
loopback Redis, for 256, 1,024 and 4,096 running requests spread over 4 gateways. Each
variant encodes the messages and runs one pipeline; the two alternate, median of --reps.
Ends with a RESULT line.

    .venv/bin/python bench/worker_publish.py [--redis-url URL] [--reps 15]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from redis.asyncio import Redis

from shared import streams
from shared.protocol import TokenOutput, TokenOutputs, encode

NUM_GATEWAYS = 4
SIZES = (256, 1024, 4096)


def iteration_outputs(num: int) -> dict[str, list[TokenOutput]]:
    """One decode token for each of ``num`` requests (the gateway's id format), grouped by
    the gateway that asked."""
    by_stream: dict[str, list[TokenOutput]] = {}
    for index in range(num):
        stream = f"superinfer:gateway:bench-{index % NUM_GATEWAYS}:outputs"
        out = TokenOutput(f"cmpl-{index:032x}", 17, [1000 + index % 30000])
        by_stream.setdefault(stream, []).append(out)
    return by_stream


async def per_request(redis: Redis, by_stream: dict[str, list[TokenOutput]]) -> float:
    t_start = time.perf_counter()
    async with redis.pipeline(transaction=False) as pipe:
        for stream, outputs in by_stream.items():
            for out in outputs:
                data = encode(out)
                pipe.xadd(stream, {"m": data}, maxlen=streams.MAXLEN_OUTPUTS, approximate=True)
        await pipe.execute()
    return time.perf_counter() - t_start


async def batched(redis: Redis, by_stream: dict[str, list[TokenOutput]]) -> float:
    t_start = time.perf_counter()
    async with redis.pipeline(transaction=False) as pipe:
        for stream, outputs in by_stream.items():
            data = encode(TokenOutputs(outputs))
            pipe.xadd(stream, {"m": data}, maxlen=streams.MAXLEN_OUTPUTS, approximate=True)
        await pipe.execute()
    return time.perf_counter() - t_start


async def main_async(args: argparse.Namespace) -> None:
    redis = Redis.from_url(args.redis_url)
    names = [f"superinfer:gateway:bench-{g}:outputs" for g in range(NUM_GATEWAYS)]
    figures: dict[str, float] = {}
    try:
        for num in SIZES:
            by_stream = iteration_outputs(num)
            old: list[float] = []
            new: list[float] = []
            for _ in range(args.reps):
                old.append(await per_request(redis, by_stream))
                new.append(await batched(redis, by_stream))
            old_ms, new_ms = statistics.median(old) * 1e3, statistics.median(new) * 1e3
            figures[f"per_request_ms_{num}"] = old_ms
            figures[f"batched_ms_{num}"] = new_ms
            figures[f"speedup_{num}"] = old_ms / new_ms
            print(
                f"{num:5d} outputs: per request {old_ms:7.2f} ms  batched {new_ms:6.2f} ms"
                f"  ({old_ms / new_ms:.1f}x)"
            )
    finally:
        await redis.delete(*names)
        await redis.aclose()
    keys = [f"{kind}_{num}" for num in (1024, 4096) for kind in ("per_request_ms", "batched_ms")]
    keys += ["speedup_256", "speedup_1024", "speedup_4096"]
    print("RESULT worker_publish " + " ".join(f"{key}={figures[key]:.2f}" for key in keys))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/8",
        help="a database of its own (the tests use db 9); the bench deletes its streams",
    )
    parser.add_argument("--reps", type=int, default=15)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
