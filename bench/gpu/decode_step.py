"""Decode step time of our engine's model path on a Llama-3-8B-shaped random model (bf16).

Batch 1/32/64/128 at context 1024, block 16, the current (eager torch) attention path over the
block-first paged KV. Prints ms per step and the ratio to the roofline (weights + KV bytes at
the measured device copy bandwidth). Baseline for the GPU data-path issue; needs CUDA.

    python bench/gpu/decode_step.py [--batches 1,32,64,128] [--context 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data_plane.engine.model_runner import BatchItem, ModelRunner
from data_plane.engine.request import Request
from data_plane.engine.sampling import SamplingParams
from data_plane.kv.geometry import KVGeometry
from data_plane.models.config import ModelConfig
from data_plane.models.llama import LlamaModel

LLAMA3_8B = dict(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)


def device_bandwidth_bytes_s() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * 10 * src.numel() / (time.perf_counter() - start)  # read + write


def time_decode(
    model: LlamaModel,
    runner: ModelRunner,
    kv: torch.Tensor,
    batch: int,
    context: int,
    block_size: int,
) -> float:
    blocks_per_seq = -(-(context + 1) // block_size)
    items = []
    for index in range(batch):
        request = Request(f"r{index}", [1] * context, SamplingParams(temperature=0), 0.0, index)
        request.output_token_ids = [5]
        request.num_computed_tokens = context
        ids = list(range(index * blocks_per_seq, (index + 1) * blocks_per_seq))
        items.append(BatchItem(request, 1, ids))
    input_ids, positions, meta, _, logits_index = runner._prepare(items)
    for _ in range(3):
        model(input_ids, positions, kv, meta, logits_index)
    torch.cuda.synchronize()
    repeats = 10
    start = time.perf_counter()
    for _ in range(repeats):
        model(input_ids, positions, kv, meta, logits_index)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,32,64,128")
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("decode_step: needs a CUDA device", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    config = ModelConfig(**LLAMA3_8B, dtype=torch.bfloat16)  # type: ignore[arg-type]
    with torch.device("cuda"):
        model = LlamaModel(config).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    block_size = 16
    geometry = KVGeometry(32, block_size, 8, 128, torch.bfloat16)
    num_blocks = max(batches) * (-(-(args.context + 1) // block_size))
    kv = geometry.allocate(num_blocks, "cuda")
    runner = ModelRunner(model, block_size, "cuda")
    bandwidth = device_bandwidth_bytes_s()
    rows = []
    for batch in batches:
        step_s = time_decode(model, runner, kv, batch, args.context, block_size)
        kv_bytes = batch * args.context * config.kv_bytes_per_token
        roofline_s = (weight_bytes + kv_bytes) / bandwidth
        rows.append(
            {
                "batch": batch,
                "context": args.context,
                "ours_ms": step_s * 1e3,
                "roofline_ms": roofline_s * 1e3,
                "ratio_to_roofline": step_s / roofline_s,
            }
        )
        print(
            f"batch {batch:4d}: ours {step_s * 1e3:8.2f} ms  roofline {roofline_s * 1e3:6.2f} ms"
            f"  ratio {step_s / roofline_s:5.2f}",
            flush=True,
        )
    out = Path(os.environ.get("OUT", "."))
    (out / "decode_step.json").write_text(
        json.dumps(
            {"device": torch.cuda.get_device_name(), "bandwidth_bytes_s": bandwidth, "rows": rows},
            indent=2,
        )
    )
    b64 = next((r for r in rows if r["batch"] == 64), rows[-1])
    print(
        f"RESULT decode_step ours_ms_b64={b64['ours_ms']:.2f} "
        f"roofline_ms_b64={b64['roofline_ms']:.2f} ratio_b64={b64['ratio_to_roofline']:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
