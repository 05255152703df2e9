"""CPU matmul kernels for weights kept quantized: time per call for SmolLM2-135M's shapes.

For each layer shape (out x in) and number of input rows M (1 = one decode stream, 8, 32,
256 = a prefill chunk), the median of ``--repeats`` calls, alternated kernel by kernel:

- ``int4``: ``quant.Int4Linear`` (torch's ``_weight_int4pack_mm_for_cpu``, bf16 activations;
  from ``DENSE_MIN_ROWS`` rows on, a dequantized bf16 matmul), the layers of a Q4 GGUF;
- ``int4_fp32``: the same kernel fed float32 activations (why the layers compute in bf16);
- ``int8``: ``quant.Int8Linear`` (``_weight_int8pack_mm``), per-row int8;
- ``bf16`` / ``fp32``: a dense ``F.linear`` with the weight in that dtype.

Ends with ``RESULT quant_matmul`` giving, at M=1 and M=8 summed over one decoder layer's four
matmuls (qkv, o, gate_up, down), the speed-up of int4 over fp32 and over bf16.

    .venv/bin/python bench/quant_matmul.py [--threads 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_plane.models.quant import int4_linear, int8_linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 8, 32, 256)


def kernels(out_f: int, in_f: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (out_f, in_f), generator=generator, dtype=torch.uint8)
    scale = torch.rand(out_f, in_f // 32, generator=generator) * 0.01
    offset = -8 * scale
    int4 = int4_linear(codes, scale, offset, None)
    weight = int4.dequantized().float()
    int8 = int8_linear(weight)
    weight_bf16 = weight.bfloat16()
    scale_zeros = int4.scale_zero_bits.view(torch.bfloat16)

    def int4_fp32(x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(
            x, int4.packed, int4.group_size, scale_zeros.float()
        )

    return {
        "int4": int4,
        "int4_fp32": int4_fp32,
        "int8": int8,
        "bf16": lambda x: F.linear(x.bfloat16(), weight_bf16),
        "fp32": lambda x: F.linear(x, weight),
    }


def median_us(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads} load {os.getloadavg()[0]:.2f} (median us per call)")
    totals: dict[tuple[str, int], float] = {}
    for name, (out_f, in_f) in SHAPES.items():
        fns = kernels(out_f, in_f)
        for rows in ROWS:
            x = torch.randn(rows, in_f)
            for fn in fns.values():  # warm up
                fn(x)
            times = {kernel: 0.0 for kernel in fns}
            for _ in range(2):  # alternated: every kernel once, then again
                for kernel, fn in fns.items():
                    times[kernel] += median_us(fn, x, args.repeats) / 2
            cells = " ".join(f"{kernel}={us:8.0f}" for kernel, us in times.items())
            print(f"{name:>8} {out_f}x{in_f} M={rows:<4} {cells}", flush=True)
            for kernel, us in times.items():
                totals[(kernel, rows)] = totals.get((kernel, rows), 0.0) + us
    ratios = [
        f"int4_vs_{base}_m{rows}={totals[(base, rows)] / totals[('int4', rows)]:.2f}"
        for rows in (1, 8)
        for base in ("fp32", "bf16", "int4_fp32")
    ]
    print(f"RESULT quant_matmul {' '.join(ratios)} load={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
