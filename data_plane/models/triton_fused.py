"""The decoder layer's element-wise steps as one Triton kernel each (the GPU path).

With these a decode layer is nine launches (norm, qkv, RoPE + K/V write, attention, o_proj,
add + norm, gate_up, SiLU x up, down) where the torch ops took 35 (tests/data_plane/
test_launch_count.py counts them):

- ``rms_norm``: RMSNorm of one row per program, the residual stream's add fused in (the sum
  written back into the residual, as the model's next step reads it).
- ``rope_write_kv``: RoPE on every q and k head of the fused qkv projection (q rotated in
  place), k and v stored at the token's cache slot (a negative slot writes nothing: a padded
  row of a CUDA-graph batch). cos/sin are the step's tables, gathered once per forward.
- ``silu_and_mul``: ``silu(gate) * up`` of the fused gate_up projection.

The arithmetic is the torch path's (``llama.py``): fp32 inside, rounded to the model's dtype
where torch rounds, so a bf16 model's values differ only by the order of a row's reduction.
Kernels are jitted on first use, so ``TRITON_INTERPRET`` set before then runs them on CPU
tensors (the tests).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import torch

from data_plane.models.triton_attention import triton_available

tl: Any = None  # triton.language, bound on the first launch (see triton_attention)

SILU_BLOCK = 1024  # columns of the intermediate activation per program


def _next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


# ---- kernels (plain functions, jitted on first use) -------------------------------------


def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + row * stride_r + cols
        total = (x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(
            residual_ptr.dtype.element_ty
        )
        tl.store(r_ptrs, total, mask=mask)
        x = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask)


def _rope_write_kv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    slot_rows_ptr,
    layer_row_offset,
    block_size,
    stride_qkv,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    HALF_P: tl.constexpr = HEAD_DIM_P // 2
    ROW: tl.constexpr = NUM_KV_HEADS * HEAD_DIM  # elements of one cache row
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_P)  # q heads, then k heads
    half = tl.arange(0, HALF_P)
    mask = (heads[:, None] < NUM_HEADS + NUM_KV_HEADS) & (half[None, :] < HALF)
    src = qkv_ptr + token * stride_qkv + heads[:, None] * HEAD_DIM + half[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_cs + half, mask=half < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + token * stride_cs + half, mask=half < HALF, other=0.0)[None, :]
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    is_q = heads[:, None] < NUM_HEADS
    tl.store(src, out1.to(qkv_ptr.dtype.element_ty), mask=mask & is_q)
    tl.store(src + HALF, out2.to(qkv_ptr.dtype.element_ty), mask=mask & is_q)

    slot = tl.load(slot_rows_ptr + token)
    row = tl.maximum(slot, 0) + layer_row_offset
    # the slot test as a block (the interpreter rejects a scalar mask term)
    k_mask = mask & ~is_q & ((tl.zeros([HEADS_P], tl.int64) + slot) >= 0)[:, None]
    k_head = tl.maximum(heads - NUM_HEADS, 0)
    k_dst = cache_ptr + row * ROW + k_head[:, None] * HEAD_DIM + half[None, :]
    tl.store(k_dst, out1.to(cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_dst + HALF, out2.to(cache_ptr.dtype.element_ty), mask=k_mask)

    kv_heads = tl.arange(0, KV_HEADS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    v_ok = (kv_heads < NUM_KV_HEADS) & ((tl.zeros([KV_HEADS_P], tl.int64) + slot) >= 0)
    v_mask = v_ok[:, None] & (dims[None, :] < HEAD_DIM)
    v_src = qkv_ptr + token * stride_qkv + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
    v = tl.load(v_src + kv_heads[:, None] * HEAD_DIM + dims[None, :], mask=v_mask, other=0.0)
    v_dst = cache_ptr + (row + block_size) * ROW + kv_heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(v_dst, v.to(cache_ptr.dtype.element_ty), mask=v_mask)


def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask)


@dataclass(frozen=True, slots=True)
class _Kernels:
    rms_norm: Any
    rope_write_kv: Any
    silu_and_mul: Any


@functools.cache
def _kernels() -> _Kernels:
    global tl
    if not triton_available():
        raise RuntimeError("the Triton path needs triton (pip install triton)")
    triton = importlib.import_module("triton")
    tl = importlib.import_module("triton.language")
    return _Kernels(
        triton.jit(_rms_norm_kernel),
        triton.jit(_rope_write_kv_kernel),
        triton.jit(_silu_and_mul_kernel),
    )


def kernel_functions() -> tuple[Any, ...]:
    """The jitted kernels (for the tests' launch counts and the ahead-of-time compile)."""
    kernels = _kernels()
    return (kernels.rms_norm, kernels.rope_write_kv, kernels.silu_and_mul)


# ---- launches ----------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of ``residual + x``, that sum) for ``x`` [tokens, hidden]; the sum is written
    into ``residual``. ``residual`` None: the norm of ``x``, and ``x`` as the stream."""
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out, x if residual is None else residual
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs rows with contiguous columns")
    block = _next_pow2(hidden)
    _kernels().rms_norm[(num_tokens,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        out.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, x if residual is None else residual


def rope_write_kv(
    qkv: torch.Tensor,
    heads: tuple[int, int, int],
    rope: tuple[torch.Tensor, torch.Tensor],
    cache_rows: torch.Tensor,
    slot_rows: torch.Tensor,
    offsets: tuple[int, int],
) -> torch.Tensor:
    """RoPE on the q and k heads of ``qkv`` [tokens, (heads + 2 kv_heads) * head_dim], k and v
    stored at ``slot_rows`` (+ ``offsets`` = (layer row offset, block size)); the rotated q
    ``[tokens, heads, head_dim]``, a view of ``qkv``. ``rope``: cos and sin, [tokens, .., d/2]."""
    num_heads, num_kv_heads, head_dim = heads
    num_tokens = qkv.shape[0]
    if qkv.stride(-1) != 1 or not cache_rows.is_contiguous():
        raise ValueError(
            "rope_write_kv needs qkv rows with contiguous columns and a contiguous cache"
        )
    cos, sin = (table.reshape(num_tokens, head_dim // 2) for table in rope)
    if num_tokens:
        _kernels().rope_write_kv[(num_tokens,)](
            qkv,
            cos,
            sin,
            cache_rows,
            slot_rows,
            offsets[0],
            offsets[1],
            qkv.stride(0),
            cos.stride(0),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HEADS_P=_next_pow2(num_heads + num_kv_heads),
            KV_HEADS_P=_next_pow2(num_kv_heads),
            HEAD_DIM_P=max(2, _next_pow2(head_dim)),
        )
    return qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [tokens, 2 * width] (gate first)."""
    num_tokens, double = gate_up.shape
    width = double // 2
    out = gate_up.new_empty((num_tokens, width))
    if num_tokens == 0:
        return out
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_and_mul needs rows with contiguous columns")
    grid = (num_tokens, -(-width // SILU_BLOCK))
    _kernels().silu_and_mul[grid](
        gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=SILU_BLOCK, num_warps=4
    )
    return out
