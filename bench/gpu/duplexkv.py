"""DuplexKV rotation bandwidth on one GPU, against the same run's raw copy ceiling.

Llama-3-8B-shaped KV in the block-first layout (32 layers, K/V, 16 tokens, 8 KV heads, head_dim
128, bf16: 2 MiB per block). An HBM pool and a pinned DRAM pool of ``2 * N`` blocks each, N
blocks moved each way (4 GiB = 2,048 blocks by default), block ids shuffled with a fixed seed so
merging cannot collapse them into one segment. Measured (warm-up first, median of 3, wall
clock from submit to completion, GB = 1e9 bytes):

(a) ``naive``: one copy call per layer per K/V per block (vLLM layout), one direction at a
    time, on a subset of blocks (``--naive-blocks``);
(b) ``cuda``: one ``cudaMemcpyBatchAsync`` per direction, one direction at a time;
(c) ``cuda`` full duplex: both directions in one submit (aggregate = 2 N blocks / elapsed);
(d) ceiling: contiguous 4 MiB pinned copies with torch on two streams, one direction at a
    time, then both at once.

Correctness: a DRAM -> HBM -> DRAM round trip and sampled blocks of the timed copies are
compared bitwise. Writes ``$OUT/duplexkv.json`` (else ./duplexkv.json). The last line is
``RESULT duplexkv duplex_gbps=.. ceiling_gbps=.. frac_of_ceiling=.. speedup_vs_naive=..
h2d_gbps=.. d2h_gbps=..`` where h2d/d2h are (b) and speedup is (c) per direction over (a).

    .venv/bin/python bench/gpu/duplexkv.py [--gib-each-way 4] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data_plane.transfer.base import BlockCopy, TransferEngine, merge_runs

BLOCK_SHAPE = (32, 2, 16, 8, 128)  # layers, K/V, block_size, kv_heads, head_dim
DTYPE = torch.bfloat16
BLOCK_BYTES = int(np.prod(BLOCK_SHAPE)) * 2  # 2 MiB
GB = 1e9


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib-each-way", type=float, default=4.0)
    p.add_argument("--quick", action="store_true", help="256 MiB each way (smoke test)")
    p.add_argument("--naive-blocks", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds per call (after one warm-up call), device synchronized around each call."""
    fn()
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def rate(nbytes: int, seconds: list[float]) -> dict[str, float]:
    med = statistics.median(seconds)
    return {
        "gbps": round(nbytes / GB / med, 2),
        "best_gbps": round(nbytes / GB / min(seconds), 2),
        "median_ms": round(med * 1e3, 2),
    }


def make_pools(num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    hbm = torch.empty((num_blocks, *BLOCK_SHAPE), dtype=DTYPE, device="cuda")
    t0 = time.perf_counter()
    dram = torch.empty((num_blocks, *BLOCK_SHAPE), dtype=DTYPE, pin_memory=True)
    pin_s = time.perf_counter() - t0
    step = 256
    scratch = torch.empty((step, *BLOCK_SHAPE), dtype=torch.int16, device="cuda")
    for i in range(0, num_blocks, step):  # random bits in both pools, different everywhere
        n = min(step, num_blocks - i)
        dram[i : i + n].view(torch.int16).copy_(scratch[:n].random_())
        hbm[i : i + n].view(torch.int16).random_()
    torch.cuda.synchronize()
    return hbm, dram, pin_s


def plan(n_each: int, pool: int, seed: int) -> tuple[list[BlockCopy], list[BlockCopy]]:
    """Scattered, disjoint: H2D DRAM->HBM and D2H HBM->DRAM touch different blocks."""
    rng = np.random.default_rng(seed)
    hbm_ids, dram_ids = rng.permutation(pool).tolist(), rng.permutation(pool).tolist()
    h2d = [BlockCopy(s, d) for s, d in zip(dram_ids[:n_each], hbm_ids[:n_each], strict=True)]
    d2h = [BlockCopy(s, d) for s, d in zip(hbm_ids[n_each:], dram_ids[n_each:], strict=True)]
    return h2d, d2h


def run(engine: TransferEngine, h2d: list[BlockCopy], d2h: list[BlockCopy]) -> None:
    for handle in engine.submit(h2d, d2h):
        if handle is not None:
            handle.wait()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # bitwise (NaN-safe) comparison of bf16 blocks


def check_copied(
    hbm: torch.Tensor, dram: torch.Tensor, h2d: list[BlockCopy], d2h: list[BlockCopy], sample: int
) -> bool:
    ok = all(torch.equal(bits(hbm[c.dst].cpu()), bits(dram[c.src])) for c in h2d[:sample])
    return ok and all(torch.equal(bits(dram[c.dst]), bits(hbm[c.src].cpu())) for c in d2h[:sample])


def round_trip(
    engine: TransferEngine, dram: torch.Tensor, h2d: list[BlockCopy], d2h: list[BlockCopy], n: int
) -> bool:
    """DRAM blocks A -> HBM blocks X (h2d plan) -> DRAM blocks B (d2h destinations)."""
    there = h2d[:n]
    back = [BlockCopy(c.dst, d.dst) for c, d in zip(there, d2h[:n], strict=True)]
    run(engine, there, [])
    run(engine, [], back)
    return all(
        torch.equal(bits(dram[b.dst]), bits(dram[a.src])) for a, b in zip(there, back, strict=True)
    )


def naive_engine(hbm: torch.Tensor, dram: torch.Tensor) -> tuple[TransferEngine | None, str]:
    try:
        from data_plane.transfer.naive import NaiveTransferEngine
    except ImportError:
        return None, "inline"
    return NaiveTransferEngine(hbm, dram), "NaiveTransferEngine"


def inline_naive(src: torch.Tensor, dst: torch.Tensor, copies: list[BlockCopy]) -> Callable:
    """Per-layer per-K/V copy_ calls on a layer-first view (vLLM layout), views prebuilt."""
    s, d = src.transpose(0, 1), dst.transpose(0, 1)  # (layers, blocks, 2, ...)
    pairs = [
        (d[layer, c.dst, kv], s[layer, c.src, kv])
        for c in copies
        for layer in range(s.shape[0])
        for kv in (0, 1)
    ]

    def go() -> None:
        for out, inp in pairs:
            out.copy_(inp, non_blocking=True)

    return go


def bench_naive(
    hbm: torch.Tensor, dram: torch.Tensor, h2d: list[BlockCopy], d2h: list[BlockCopy], repeats: int
) -> dict[str, Any]:
    engine, kind = naive_engine(hbm, dram)
    res: dict[str, Any] = {
        "impl": kind,
        "blocks_each_way": len(h2d),
        "copy_calls_each_way": len(h2d) * 2 * BLOCK_SHAPE[0],
    }
    for name, (a, b) in {"h2d": (h2d, []), "d2h": ([], d2h)}.items():
        if engine is not None:
            fn: Callable[[], None] = functools.partial(run, engine, a, b)
        else:
            fn = inline_naive(dram, hbm, a) if a else inline_naive(hbm, dram, b)
        res[name] = rate(len(h2d) * BLOCK_BYTES, timed(fn, repeats))
    if engine is not None:
        engine.close()
    return res


def bench_cuda(
    engine: Any, h2d: list[BlockCopy], d2h: list[BlockCopy], repeats: int
) -> dict[str, Any]:
    nbytes = len(h2d) * BLOCK_BYTES
    res: dict[str, Any] = {}
    for name, (a, b, total) in {
        "h2d": (h2d, [], nbytes),
        "d2h": ([], d2h, nbytes),
        "duplex": (h2d, d2h, 2 * nbytes),
    }.items():
        res[name] = rate(total, timed(functools.partial(run, engine, a, b), repeats))
        res[name]["enqueue_ms"] = round(engine.stats.last_enqueue_s * 1e3, 3)
    res["duplex"]["per_direction_gbps"] = round(res["duplex"]["gbps"] / 2, 2)
    res["batched"] = engine.batched
    return res


def bench_ceiling(
    hbm: torch.Tensor, dram: torch.Tensor, n_each: int, repeats: int
) -> dict[str, Any]:
    """Contiguous 4 MiB chunks (2 blocks): DRAM[0:N] -> HBM[0:N], HBM[N:2N] -> DRAM[N:2N]."""
    up = [(hbm[i : i + 2], dram[i : i + 2]) for i in range(0, n_each - 1, 2)]
    down = [(dram[i : i + 2], hbm[i : i + 2]) for i in range(n_each, 2 * n_each - 1, 2)]
    s_up, s_down = torch.cuda.Stream(), torch.cuda.Stream()
    nbytes = len(up) * 2 * BLOCK_BYTES

    def one(pairs: list, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            for out, inp in pairs:
                out.copy_(inp, non_blocking=True)

    def both() -> None:
        for (o1, i1), (o2, i2) in zip(up, down, strict=True):
            with torch.cuda.stream(s_up):
                o1.copy_(i1, non_blocking=True)
            with torch.cuda.stream(s_down):
                o2.copy_(i2, non_blocking=True)

    return {
        "h2d": rate(nbytes, timed(lambda: one(up, s_up), repeats)),
        "d2h": rate(nbytes, timed(lambda: one(down, s_down), repeats)),
        "duplex": rate(2 * nbytes, timed(both, repeats)),
        "chunk_mib": 4,
    }


def print_table(res: dict[str, Any]) -> None:
    rows = [
        (
            "naive (per layer/KV/block)",
            res["naive"]["h2d"]["gbps"],
            res["naive"]["d2h"]["gbps"],
            "-",
        )
    ]
    for label, key in (("cuda batched", "cuda"), ("ceiling 4 MiB torch", "ceiling")):
        r = res[key]
        rows.append((label + " U", r["h2d"]["gbps"], r["d2h"]["gbps"], "-"))
        rows.append((label + " B (duplex)", "-", "-", r["duplex"]["gbps"]))
    print(f"{'config':32} {'H2D GB/s':>10} {'D2H GB/s':>10} {'both GB/s':>10}")
    for row in rows:
        print(f"{row[0]:32} {row[1]!s:>10} {row[2]!s:>10} {row[3]!s:>10}")


def summarize(res: dict[str, Any]) -> str:
    duplex, ceiling = res["cuda"]["duplex"]["gbps"], res["ceiling"]["duplex"]["gbps"]
    naive = (res["naive"]["h2d"]["gbps"] + res["naive"]["d2h"]["gbps"]) / 2
    res["summary"] = {
        "duplex_gbps": duplex,
        "ceiling_gbps": ceiling,
        "frac_of_ceiling": round(duplex / ceiling, 4),
        "speedup_vs_naive": round(duplex / 2 / naive, 2),
        "h2d_gbps": res["cuda"]["h2d"]["gbps"],
        "d2h_gbps": res["cuda"]["d2h"]["gbps"],
    }
    return "RESULT duplexkv " + " ".join(f"{k}={v}" for k, v in res["summary"].items())


def measure(engine: Any, hbm: torch.Tensor, dram: torch.Tensor, args: argparse.Namespace) -> dict:
    """Every section in order, each printed as soon as it is measured."""
    n_each = hbm.shape[0] // 2
    h2d, d2h = plan(n_each, 2 * n_each, args.seed)
    naive_n = min(args.naive_blocks, n_each)
    res: dict[str, Any] = {}
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("correct_round_trip", lambda: round_trip(engine, dram, h2d, d2h, min(64, n_each))),
        ("naive", lambda: bench_naive(hbm, dram, h2d[:naive_n], d2h[:naive_n], args.repeats)),
        ("cuda", lambda: bench_cuda(engine, h2d, d2h, args.repeats)),
        ("correct_after_duplex", lambda: check_copied(hbm, dram, h2d, d2h, sample=128)),
        ("ceiling", lambda: bench_ceiling(hbm, dram, n_each, args.repeats)),
    ]
    for name, fn in sections:
        res[name] = fn()
        print(f"{name}: {json.dumps(res[name])}", flush=True)
    res["cuda"]["segments_each_way"] = [len(merge_runs(h2d)), len(merge_runs(d2h))]
    return res


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("duplexkv: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    try:
        from data_plane.transfer.cuda import CudaTransferEngine
    except ImportError as exc:
        print(f"duplexkv: cannot import the cuda transfer backend: {exc}", file=sys.stderr)
        return 2
    gib = 0.25 if args.quick else args.gib_each_way
    n_each = max(2, int(gib * 2**30) // BLOCK_BYTES) // 2 * 2
    t_start = time.perf_counter()
    hbm, dram, pin_s = make_pools(2 * n_each)
    try:
        engine = CudaTransferEngine(hbm, dram)
    except RuntimeError as exc:
        print(f"duplexkv: {exc}", file=sys.stderr)
        return 2
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "block_bytes": BLOCK_BYTES,
        "blocks_each_way": n_each,
        "gib_each_way": n_each * BLOCK_BYTES / 2**30,
        "pin_s": round(pin_s, 2),
        "pin_gbps": round(dram.numel() * 2 / GB / pin_s, 2),
    }
    print(json.dumps(res), flush=True)
    res.update(measure(engine, hbm, dram, args))
    engine.close()
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    line = summarize(res)
    print_table(res)
    (Path(os.environ.get("OUT", ".")) / "duplexkv.json").write_text(json.dumps(res, indent=1))
    print(f"wall_s={res['wall_s']} batched={res['cuda']['batched']}")
    print(line)
    return 0 if res["correct_round_trip"] and res["correct_after_duplex"] else 1


if __name__ == "__main__":
    sys.exit(main())
