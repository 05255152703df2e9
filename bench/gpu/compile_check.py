"""Compile the Triton attention kernels for an NVIDIA target without a GPU (a pre-flight check).

Triton's interpreter (the CPU tests) does not run the compiler, so shapes it accepts can still
fail to compile (tl.dot's minimum sizes, types, constexpr branches). This compiles each kernel
ahead of time for sm_90 (H200) with the specialisation a launch gets (pointers and the strides
named ``stride_*`` / ``rows_per_block`` 16-aligned) and reports whether the context loads were
vectorised into pipelined async copies. Needs triton with its bundled ptxas, no GPU; must run
without ``TRITON_INTERPRET`` (the tests start it in a fresh process).

    .venv/bin/python bench/gpu/compile_check.py [--arch 90]

Ends with ``RESULT compile_check kernels=N async_copies=yes|no``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

INT64_POINTERS = {
    "block_tables_ptr",
    "context_lens_ptr",
    "query_starts_ptr",
    "slot_rows_ptr",
    "tile_seq_ids_ptr",
    "tile_offsets_ptr",
}


# fp32 whatever the model: the fused RoPE's tables, split decodes' partial outputs
FP32_POINTERS = {"cos_ptr", "sin_ptr", "partial_ptr", "lse_ptr"}
FP32_SCALARS = {"qk_scale", "eps"}


def compile_kernel(
    fn: Any, pointer_type: str, constants: dict[str, Any], arch: int, num_warps: int = 4
) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = JITFunction(fn)
    signature: dict[str, str] = {}
    aligned: list[str] = []
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*i64" if name in INT64_POINTERS else pointer_type
            signature[name] = "*fp32" if name in FP32_POINTERS else signature[name]
            aligned.append(name)
        else:
            signature[name] = "fp32" if name in FP32_SCALARS else "i32"
            if name.startswith("stride_") or name == "rows_per_block":
                aligned.append(name)
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(kernel, signature, constexprs=constants, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(source, target=target, options={"num_warps": num_warps, "num_stages": 2})


def attention_cases() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, pointer type, constexprs): Llama-3-8B decode and prefill tiles in bf16,
    stories260K's fp32 shape (head_dim 8 padded to 16) with a sliding window."""
    import triton.language as tl

    from data_plane.models import triton_attention as ta
    from data_plane.models.paged_batch import tile_block_q

    cases = []
    for name, pointer, group, head_dim, prefill, window, splits in (
        ("llama3-8b decode bf16", "*bf16", 4, 128, False, 0, 1),
        ("llama3-8b decode bf16, context in 16 splits", "*bf16", 4, 128, False, 0, 16),
        ("llama3-8b prefill bf16", "*bf16", 4, 128, True, 0, 1),
        ("stories260K prefill fp32 window", "*fp32", 2, 8, True, 24, 1),
    ):
        fp32 = pointer == "*fp32"
        constants = {
            "NUM_KV_HEADS": 8,
            "GROUP": group,
            "GROUP_P": group,
            "HEAD_DIM": head_dim,
            "HEAD_DIM_P": max(16, head_dim),
            "KV_ALIGN": head_dim,
            "BLOCK_Q": tile_block_q(group, prefill=prefill),
            "BLOCK_N": ta.PREFILL_BLOCK_N if prefill else ta.DECODE_BLOCK_N,
            "SLIDING_WINDOW": window,
            "DOT_DTYPE": tl.float32 if fp32 else tl.bfloat16,
            "PRECISION": "ieee" if fp32 else "tf32",
            "NUM_SPLITS": splits,
        }
        cases.append((name, pointer, constants))
    return cases


def compile_fused(arch: int) -> int:
    """The fused element-wise kernels (``triton_fused``) at Llama-3-8B's shape in bf16."""
    from data_plane.models import triton_fused as tf

    tf._kernels()
    norm = {"HAS_RESIDUAL": True, "BLOCK": 4096}
    compile_kernel(tf._rms_norm_kernel, "*bf16", norm, arch, num_warps=16)
    print("rms_norm + residual bf16 (hidden 4096): ok")
    rope = {
        "NUM_HEADS": 32,
        "NUM_KV_HEADS": 8,
        "HEAD_DIM": 128,
        "HEADS_P": 64,
        "KV_HEADS_P": 8,
        "HEAD_DIM_P": 128,
    }
    compile_kernel(tf._rope_write_kv_kernel, "*bf16", rope, arch)
    print("rope_write_kv bf16 (32 / 8 heads, head_dim 128): ok")
    compile_kernel(tf._silu_and_mul_kernel, "*bf16", {"BLOCK": tf.SILU_BLOCK}, arch)
    print("silu_and_mul bf16: ok")
    return 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (the compiler cannot run under it)")
        return 2
    from data_plane.models import triton_attention as ta

    ta._kernels()  # imports triton (compiled mode) and binds the kernels' ``tl``
    async_copies = True
    for name, pointer, constants in attention_cases():
        compiled = compile_kernel(ta._attention_kernel, pointer, constants, args.arch)
        ttgir = compiled.asm["ttgir"]
        pipelined = "async_copy_global_to_local" in ttgir
        async_copies &= pipelined or pointer == "*fp32"
        mma = "mma" in compiled.asm["ptx"]
        print(f"{name}: ok, shared {compiled.metadata.shared} B, mma {mma}, async {pipelined}")
    write = {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "KV_HEADS_P": 8, "HEAD_DIM_P": 128}
    compile_kernel(ta._write_kv_kernel, "*bf16", write, args.arch)
    print("write_kv bf16: ok")
    combine = {"NUM_HEADS": 32, "HEAD_DIM": 128, "HEAD_DIM_P": 128, "NUM_SPLITS": 16}
    compile_kernel(ta._combine_splits_kernel, "*bf16", combine, args.arch)
    print("combine_splits bf16 (16 splits): ok")
    num_fused = compile_fused(args.arch)
    copies = "yes" if async_copies else "no"
    print(f"RESULT compile_check kernels={6 + num_fused} async_copies={copies}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
