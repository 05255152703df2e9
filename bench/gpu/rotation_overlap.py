"""Does DuplexKV rotation traffic hide under a decode iteration? (P2: iteration <= 1.05x)

Llama-3-8B-shaped random model (bf16), a decode batch of 64 at context 1024 replayed as a CUDA
graph, the engine's ``cuda`` transfer backend. Each iteration does what an engine step does:
submit the iteration's block copies (N blocks each way, scattered ids, disjoint from the
batch's blocks), run the decode step, sample (argmax: a host sync), then (here) wait for the
copies so that none pile up. Per configuration, medians over the iterations of:

- ``iteration_ms``: wall time of the whole iteration; ``ratio`` = with traffic / without (P2);
- from CUDA events recorded on the compute stream and on both copy streams (one device clock):
  ``compute_ms`` (the model step), ``copy_ms`` (first copy start to last copy end),
  ``overlap_frac`` (the share of the copy interval inside the compute interval) and
  ``exposed_ms`` (copy time after the compute ended).

N per direction: ``auto`` = ``lab.costmodel.auto_b_xfer_blocks`` (what one direction of the
H200 profile's link moves during the compute-only step), and half and twice that. Writes
``$OUT/rotation_overlap.json``; last line ``RESULT rotation_overlap ratio_auto=..
compute_ratio_auto=.. overlap_frac_auto=.. exposed_ms_auto=.. b_xfer_auto=.. iteration_ms=..
max_ratio_within_auto=..``.

    python bench/gpu/rotation_overlap.py [--batch 64] [--context 1024] [--iterations 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu.model_shapes import LLAMA3_8B, build_model, decode_items
from data_plane.engine.model_runner import ModelRunner
from data_plane.kv.geometry import KVGeometry
from data_plane.transfer import BlockCopy, make_transfer_engine
from lab.costmodel import auto_b_xfer_blocks, load_profile

BLOCK_SIZE = 16


def copy_lists(
    per_direction: int, first_hbm: int, rng: np.random.Generator
) -> tuple[list[BlockCopy], list[BlockCopy]]:
    """H2D: DRAM [0, n) -> HBM area A; D2H: HBM area B -> DRAM [n, 2n); ids shuffled so
    that adjacent blocks do not merge into one segment. A and B are disjoint."""
    n = per_direction
    into = (first_hbm + rng.permutation(n)).tolist()
    out_of = (first_hbm + n + rng.permutation(n)).tolist()
    h2d = [BlockCopy(src, dst) for src, dst in zip(rng.permutation(n).tolist(), into, strict=True)]
    d2h = [BlockCopy(src, n + i) for i, src in enumerate(out_of)]
    return h2d, d2h


def _stream_of(raw: Any) -> torch.cuda.Stream:
    """A torch view of a cuda-python stream (``int()`` is the handle; ``getPtr()`` would be
    the address of the handle)."""
    if hasattr(torch.cuda, "get_stream_from_external"):
        return torch.cuda.get_stream_from_external(int(raw))
    return torch.cuda.ExternalStream(int(raw))


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class Iteration:
    """One engine-like iteration with CUDA events on the compute stream (``ref`` at its start,
    ``c0``/``c1`` around the model step) and on each copy stream (``x0``/``x1`` around the
    submit), all read as ms after ``ref`` on the device clock."""

    def __init__(self, graphs: Any, batch: Any, kv: torch.Tensor, transfer: Any) -> None:
        self.graphs, self.batch, self.kv, self.transfer = graphs, batch, kv, transfer
        self.copy_streams = []
        if transfer is not None:
            self.copy_streams = [_stream_of(transfer.h2d_stream), _stream_of(transfer.d2h_stream)]
        self.ev = {name: _event() for name in ("ref", "c0", "c1")}
        for i in range(len(self.copy_streams)):
            self.ev[f"x0_{i}"], self.ev[f"x1_{i}"] = _event(), _event()

    def run(self, copies: tuple[list[BlockCopy], list[BlockCopy]]) -> dict[str, float]:
        t0 = time.perf_counter()
        self.ev["ref"].record()
        handles: tuple = ()
        if copies[0] or copies[1]:
            for i, stream in enumerate(self.copy_streams):
                self.ev[f"x0_{i}"].record(stream)
            handles = self.transfer.submit(*copies)
            for i, stream in enumerate(self.copy_streams):
                self.ev[f"x1_{i}"].record(stream)
        self.ev["c0"].record()
        logits = self.graphs.run(self.batch, self.kv)  # the decode step (graph replay)
        self.ev["c1"].record()
        logits.argmax(dim=-1).tolist()  # sampling's host sync
        for handle in handles:
            if handle is not None:
                handle.wait()
        wall_ms = 1e3 * (time.perf_counter() - t0)
        return {"iteration_ms": wall_ms, **self._intervals(bool(handles))}

    def _intervals(self, copied: bool) -> dict[str, float]:
        names = ["c0", "c1"]
        if copied:
            names += [f"x{edge}_{i}" for edge in (0, 1) for i in range(len(self.copy_streams))]
        for name in names:
            self.ev[name].synchronize()
        at = {name: self.ev["ref"].elapsed_time(self.ev[name]) for name in names}
        row = {"compute_ms": at["c1"] - at["c0"]}
        if copied:
            start = min(at[f"x0_{i}"] for i in range(len(self.copy_streams)))
            end = max(at[f"x1_{i}"] for i in range(len(self.copy_streams)))
            copy_ms = max(end - start, 1e-6)
            overlap = max(0.0, min(end, at["c1"]) - max(start, at["c0"]))
            row.update(copy_ms=copy_ms, exposed_ms=max(0.0, end - at["c1"]))
            row["overlap_frac"] = overlap / copy_ms
        return row


def run_config(
    iteration: Iteration, copies: tuple[list[BlockCopy], list[BlockCopy]], n: int
) -> dict[str, float]:
    """Medians over ``n`` iterations (after two warm-up iterations)."""
    for _ in range(2):
        iteration.run(copies)
    samples = [iteration.run(copies) for _ in range(n)]
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--max-blocks", type=int, default=1024, help="per direction, at most")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("rotation_overlap: needs a CUDA device", file=sys.stderr)
        return 2
    model, config = build_model(LLAMA3_8B, "cuda")
    geometry = KVGeometry(
        config.num_layers, BLOCK_SIZE, config.num_kv_heads, config.head_dim, config.dtype
    )
    items = decode_items(args.batch, args.context, BLOCK_SIZE)
    batch_blocks = sum(len(item.block_ids) for item in items)
    kv = geometry.allocate(batch_blocks + 2 * args.max_blocks, "cuda")
    dram = geometry.allocate(2 * args.max_blocks, "cpu", pin=True)
    transfer = make_transfer_engine("cuda", kv, dram)
    runner = ModelRunner(model, BLOCK_SIZE, "cuda")
    if runner.graphs is None:
        print("rotation_overlap: the runner has no CUDA graphs (triton missing?)", file=sys.stderr)
        return 2
    batch, _ = runner.host_batch(items)
    iteration = Iteration(runner.graphs, batch, kv, transfer)
    alone = run_config(iteration, ([], []), args.iterations)
    profile = load_profile("h200-llama3-8b")
    auto = auto_b_xfer_blocks(profile, alone["compute_ms"] / 1e3, geometry.block_bytes)
    auto = min(auto, args.max_blocks)
    rows: list[dict[str, Any]] = [{"b_xfer_per_direction": 0, **alone}]
    print(json.dumps(rows[0]), flush=True)
    rng = np.random.default_rng(0)
    for blocks in sorted({max(1, auto // 2), auto, min(2 * auto, args.max_blocks)}):
        row = run_config(iteration, copy_lists(blocks, batch_blocks, rng), args.iterations)
        row["b_xfer_per_direction"] = blocks
        row["ratio"] = row["iteration_ms"] / alone["iteration_ms"]
        row["compute_ratio"] = row["compute_ms"] / alone["compute_ms"]
        row["copy_gbps_each_way"] = blocks * geometry.block_bytes / 1e6 / row["copy_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    transfer.close()
    return report(rows, auto, args)


def report(rows: list[dict[str, Any]], auto: int, args: argparse.Namespace) -> int:
    out = Path(os.environ.get("OUT", "."))
    document = {"device": torch.cuda.get_device_name(), "batch": args.batch,
                "context": args.context, "b_xfer_auto": auto, "rows": rows}  # fmt: skip
    (out / "rotation_overlap.json").write_text(json.dumps(document, indent=2))
    at_auto = next(r for r in rows if r["b_xfer_per_direction"] == auto)
    within = [r["ratio"] for r in rows[1:] if r["b_xfer_per_direction"] <= auto]
    print(
        f"RESULT rotation_overlap ratio_auto={at_auto['ratio']:.3f}"
        f" compute_ratio_auto={at_auto['compute_ratio']:.3f}"
        f" overlap_frac_auto={at_auto['overlap_frac']:.3f}"
        f" exposed_ms_auto={at_auto['exposed_ms']:.2f} b_xfer_auto={auto}"
        f" iteration_ms={rows[0]['iteration_ms']:.2f} max_ratio_within_auto={max(within):.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
