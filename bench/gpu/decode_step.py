"""Decode step time on a Llama-3-8B-shaped random model (bf16): ours against transformers.

Batch 1/32/64/128 at context 1024, block 16. For each batch, the step (one new token per
sequence, logits included) of:

- ``ours_graph``: the engine's GPU data path, Triton paged attention replayed as a CUDA graph
  (the static inputs' host-to-device copy included);
- ``ours_eager``: the same kernels launched eagerly;
- ``torch_eager``: our torch attention path (the gather-and-SDPA reference, the old baseline);
- ``hf_eager`` / ``hf_graph``: transformers' LlamaForCausalLM (SDPA) with a static cache of
  context + 64 tokens, eagerly and captured in a CUDA graph;
- ``roofline``: weights + the batch's KV bytes at the device copy bandwidth measured here.

Also checks on the real shape that the Triton path's logits match the torch path's (batch 1).
Writes ``$OUT/decode_step.json`` (``bench/out/`` without ``OUT``); the last line is
``RESULT decode_step ours_ms_b64=.. roofline_ms_b64=.. ratio_b64=.. hf_eager_ms_b64=..
hf_graph_ms_b64=.. speedup_vs_hf_graph_b64=..``.
``--device cpu --tiny`` is a smoke run of the same code on a tiny model (Triton interpreter,
graphs run eagerly, no transformers graph).

    python bench/gpu/decode_step.py [--batches 1,32,64,128] [--context 1024]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu.model_shapes import LLAMA3_8B, TINY, build_model, decode_items

BLOCK_SIZE = 16
HF_CACHE_SLACK = 64  # static-cache tokens beyond the context (every timed call writes one)


def device_bandwidth_bytes_s(device: str) -> float:
    src = torch.empty(1 << 30 if device == "cuda" else 1 << 24, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    _sync(device)
    return 2 * 10 * src.numel() / (time.perf_counter() - start)  # read + write


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_s(fn: Callable[[], Any], device: str, repeats: int, warmup: int = 3) -> float:
    """Mean wall seconds per call (host work included), device synchronised around the loop."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def ours_steps(
    model: Any, kv: torch.Tensor, batch: int, context: int, device: str
) -> dict[str, Callable[[], Any]]:
    """One decode step of each of our variants, inputs prepared (as the runner does)."""
    from data_plane.engine.cuda_graphs import DecodeGraphs
    from data_plane.engine.model_runner import ModelRunner, PromptRows
    from data_plane.models.paged_batch import paged_metadata

    items = decode_items(batch, context, BLOCK_SIZE)
    torch_runner = ModelRunner(model, BLOCK_SIZE, device, attention_backend="torch")
    ids, positions, meta, _, logits_index = torch_runner._prepare(items, PromptRows([], []))
    triton_runner = ModelRunner(model, BLOCK_SIZE, device, attention_backend="triton")
    host, _ = triton_runner.host_batch(items)
    paged = paged_metadata(
        host, BLOCK_SIZE, triton_runner.rows_per_block, triton_runner.heads, triton_runner.staging
    )
    graphs = triton_runner.graphs or DecodeGraphs(
        model, BLOCK_SIZE, batch, torch.device(device), capture=False
    )
    return {
        "ours_graph": lambda: graphs.run(host, kv),
        "ours_eager": lambda: model(paged[0], paged[1], kv, paged[2], paged[3]),
        "torch_eager": lambda: model(ids, positions, kv, meta, logits_index),
    }


def logits_check(steps: dict[str, Callable[[], Any]]) -> float:
    """Max |logit difference| of the Triton paths against the torch path, over its max."""
    reference = steps["torch_eager"]().float()
    scale = float(reference.abs().max()) or 1.0
    return max(
        float((steps[name]().float() - reference).abs().max()) / scale
        for name in ("ours_graph", "ours_eager")
    )


def build_hf(shape: dict[str, Any], device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = {
        "vocab_size": shape["vocab_size"],
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": shape["num_layers"],
        "num_attention_heads": shape["num_heads"],
        "num_key_value_heads": shape["num_kv_heads"],
        "head_dim": shape["head_dim"],
        "max_position_embeddings": shape["max_position_embeddings"],
        "attn_implementation": "sdpa",
    }
    config = LlamaConfig(**fields)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def hf_step(model: Any, batch: int, context: int, device: str) -> Callable[[], Any]:
    """A transformers decode step at position ``context`` over a static cache (its layers'
    write positions reset to ``context`` after the first call, where a version keeps them)."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    wanted: dict[str, Any] = {"max_batch_size": batch, "device": device, "dtype": torch.bfloat16}
    extra = {k: v for k, v in wanted.items() if k in params}
    cache = StaticCache(config=model.config, max_cache_len=context + HF_CACHE_SLACK, **extra)
    kwargs: dict[str, Any] = {
        "input_ids": torch.ones((batch, 1), dtype=torch.long, device=device),
        "position_ids": torch.full((batch, 1), context, dtype=torch.long, device=device),
        "use_cache": True,
        "logits_to_keep": 1,
    }
    forward = inspect.signature(model.forward).parameters
    kwargs["cache" if "cache" in forward else "past_key_values"] = cache
    if "cache_position" in forward:
        kwargs["cache_position"] = torch.tensor([context], device=device)

    @torch.inference_mode()
    def step() -> Any:
        return model(**kwargs).logits

    step()  # allocates the static cache
    for layer in getattr(cache, "layers", []):
        length = getattr(layer, "cumulative_length", None)
        if isinstance(length, torch.Tensor):
            length.fill_(context)
    return step


def graphed(step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` captured in a CUDA graph (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def measure_batch(
    args: argparse.Namespace, ours: Any, hf: Any, kv: torch.Tensor, batch: int
) -> dict[str, Any]:
    row: dict[str, Any] = {"batch": batch, "context": args.context}
    steps = ours_steps(ours, kv, batch, args.context, args.device)
    if batch == min(args.batch_list):
        row["triton_vs_torch_max_rel_logit_diff"] = logits_check(steps)
    for name, step in steps.items():
        row[f"{name}_ms"] = 1e3 * time_s(step, args.device, args.repeats)
    if hf is not None:
        try:
            step = hf_step(hf, batch, args.context, args.device)
            row["hf_eager_ms"] = 1e3 * time_s(step, args.device, args.repeats)
            if args.device == "cuda":
                row["hf_graph_ms"] = 1e3 * time_s(graphed(step), args.device, args.repeats)
        except Exception as exc:  # report and go on: the other rows still count
            row["hf_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32,64,128")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    args = parser.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",")]
    return args


def main() -> int:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("decode_step: needs a CUDA device (or --device cpu --tiny)", file=sys.stderr)
        return 2
    shape = TINY if args.tiny else LLAMA3_8B
    ours, config = build_model(shape, args.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    hf = None if args.no_hf else build_hf(shape, args.device)
    from data_plane.kv.geometry import KVGeometry

    geometry = KVGeometry(
        config.num_layers, BLOCK_SIZE, config.num_kv_heads, config.head_dim, config.dtype
    )
    blocks_per_seq = -(-(args.context + 1) // BLOCK_SIZE)
    kv = geometry.allocate(max(args.batch_list) * blocks_per_seq, args.device)
    bandwidth = device_bandwidth_bytes_s(args.device)
    rows = []
    for batch in args.batch_list:
        row = measure_batch(args, ours, hf, kv, batch)
        kv_bytes = batch * args.context * config.kv_bytes_per_token
        row["roofline_ms"] = 1e3 * (weight_bytes + kv_bytes) / bandwidth
        row["ratio_to_roofline"] = row["ours_graph_ms"] / row["roofline_ms"]
        rows.append(row)
        print(
            " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        )
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    document = {"device": device_name, "bandwidth_bytes_s": bandwidth, "rows": rows}
    out = Path(os.environ.get("OUT", "bench/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_step.json").write_text(json.dumps(document, indent=2))
    print(result_line(rows))
    return 0


def result_line(rows: list[dict[str, Any]]) -> str:
    row = next((r for r in rows if r["batch"] == 64), rows[-1])
    b = row["batch"]
    hf_graph = row.get("hf_graph_ms")
    speedup = hf_graph / row["ours_graph_ms"] if hf_graph else float("nan")
    return (
        f"RESULT decode_step ours_ms_b{b}={row['ours_graph_ms']:.2f}"
        f" roofline_ms_b{b}={row['roofline_ms']:.2f} ratio_b{b}={row['ratio_to_roofline']:.2f}"
        f" ours_eager_ms_b{b}={row['ours_eager_ms']:.2f}"
        f" hf_eager_ms_b{b}={row.get('hf_eager_ms', float('nan')):.2f}"
        f" hf_graph_ms_b{b}={hf_graph if hf_graph else float('nan'):.2f}"
        f" speedup_vs_hf_graph_b{b}={speedup:.2f}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
