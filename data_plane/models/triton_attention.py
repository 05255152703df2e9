"""Paged attention over the block-first KV layout in Triton (the GPU path).

The kernels read and write the cache ``(num_blocks, num_layers, 2, block_size, kv_heads,
head_dim)`` in place, through each sequence's block table (no gather of the context):

- ``_write_kv_kernel``: one program per new token stores its K and V rows; a negative slot row
  (a padded row of a CUDA-graph batch) writes nothing. (The model writes K/V with the fused
  RoPE kernel of ``triton_fused``; this one serves callers with K and V already rotated.)
- ``_attention_kernel``: one program per (query tile, KV head, context split). A tile is up to
  ``BLOCK_Q`` consecutive queries of one sequence times the query heads of one KV group (GQA),
  so a decode (one query) and a prefill chunk (causal over its own tokens and everything cached
  before it) are the same code. It walks the context in tiles of ``BLOCK_N`` tokens, mapping
  position ``p`` to row ``table[p // block_size] * rows_per_block + layer_offset + p % block_size``
  (int64 addresses), with an online softmax in fp32. Decodes whose programs would leave SMs
  idle (low batch, long context) split the context (flash-decoding, ``decode_splits``): each
  split writes its normalised output and log2-sum-exp, and ``_combine_splits_kernel`` merges
  them per (decode, head).

Kernels are compiled lazily on first use, so whether Triton runs them compiled (CUDA) or in its
interpreter (``TRITON_INTERPRET=1``, CPU tensors; the tests) is decided when they are first
launched, not when this module is imported. The torch path in ``attention.py`` is the
reference.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from data_plane.models.attention_metadata import AttentionMetadata, PagedInputs, TileSet
from data_plane.models.paged_batch import next_pow2

# triton is optional (the CPU path never needs it) and imported on the first launch: its own
# library functions are bound to the interpreter or the compiler when it is imported, so
# ``TRITON_INTERPRET`` set after this module's import still applies.
tl: Any = None

DECODE_BLOCK_N = 64  # context tokens per loop iteration
PREFILL_BLOCK_N = 32
_LOG2E = 1.4426950408889634


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---- kernels (plain functions, jitted on first use) -------------------------------------


def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_rows_ptr,
    layer_row_offset,
    block_size,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_rows_ptr + token)
    heads = tl.arange(0, KV_HEADS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    # the slot test as a block (the interpreter rejects a scalar mask term)
    head_ok = (heads < NUM_KV_HEADS) & ((tl.zeros([KV_HEADS_P], tl.int64) + slot) >= 0)
    mask = head_ok[:, None] & (dims[None, :] < HEAD_DIM)
    k = tl.load(
        k_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask
    )
    v = tl.load(
        v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask
    )
    row = tl.maximum(slot, 0) + layer_row_offset
    dst = cache_ptr + row * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    v_dst = dst + block_size * (NUM_KV_HEADS * HEAD_DIM)
    tl.store(v_dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def _attention_kernel(
    q_ptr,
    out_ptr,
    partial_ptr,
    lse_ptr,
    cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_starts_ptr,
    tile_seq_ids_ptr,
    tile_offsets_ptr,
    layer_row_offset,
    rows_per_block,
    block_size,
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_table,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    KV_ALIGN: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ids_ptr + tile)
    q_offset = tl.load(tile_offsets_ptr + tile).to(tl.int32)
    q_start = tl.load(query_starts_ptr + seq)
    q_len = (tl.load(query_starts_ptr + seq + 1) - q_start).to(tl.int32)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    num_computed = context_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_offset + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_valid = (q_idx < q_len) & (rows % GROUP_P < GROUP)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    token = q_start + q_idx
    io_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
        mask=io_mask,
        other=0.0,
    ).to(DOT_DTYPE)
    q_pos = num_computed + q_idx

    hi = tl.minimum(context_len, num_computed + q_offset + BLOCK_Q)
    lo = 0
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(num_computed + q_offset - SLIDING_WINDOW + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:  # this program's share of the context, whole BLOCK_N tiles
        split = tl.program_id(2)
        per_split = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * per_split
        hi = tl.minimum(lo + per_split, hi)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    row_stride = NUM_KV_HEADS * HEAD_DIM
    table_row = block_tables_ptr + seq * stride_table
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < hi
        block_ids = tl.load(table_row + k_pos // block_size, mask=k_valid, other=0)
        cache_row = block_ids * rows_per_block + layer_row_offset + k_pos % block_size
        # a multiple of head_dim: rows of K/V are aligned, loads vectorize
        k_off = tl.multiple_of(cache_row * row_stride + kv_head * HEAD_DIM, KV_ALIGN)
        if HEAD_DIM == HEAD_DIM_P:
            kv_mask = k_valid[:, None] & (dims[None, :] >= 0)
        else:
            kv_mask = k_valid[:, None] & dim_valid[None, :]
        k = tl.load(cache_ptr + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v_off = k_off + block_size * row_stride
        v = tl.load(cache_ptr + v_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS > 1:  # the split's normalised output and log2-sum-exp, fp32, for the combine
        slot = (token * (NUM_KV_HEADS * GROUP) + head) * NUM_SPLITS + tl.program_id(2)
        tl.store(partial_ptr + slot[:, None] * HEAD_DIM_P + dims[None, :], out, mask=io_mask)
        empty = l_i == 0.0  # a split past the context: weight 0 in the combine
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(lse_ptr + slot, lse, mask=row_valid)
    else:
        tl.store(
            out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )


def _combine_splits_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_P)
    slot = (token * NUM_HEADS + head) * NUM_SPLITS + splits
    lse = tl.load(lse_ptr + slot)
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # 0 for empty splits
    part = tl.load(partial_ptr + slot[:, None] * HEAD_DIM_P + dims[None, :])
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * part, 0) / tl.where(total == 0.0, 1.0, total)
    dst = out_ptr + token * stride_o_tok + head * stride_o_head + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@dataclass(frozen=True, slots=True)
class _Kernels:
    write_kv: Any
    attention: Any
    combine_splits: Any
    dtypes: dict[torch.dtype, Any]  # torch dtype -> triton dtype


@functools.cache
def _kernels() -> _Kernels:
    global tl
    if not triton_available():
        raise RuntimeError("the Triton attention path needs triton (pip install triton)")
    triton = importlib.import_module("triton")
    tl = importlib.import_module("triton.language")
    dtypes = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    return _Kernels(
        triton.jit(_write_kv_kernel),
        triton.jit(_attention_kernel),
        triton.jit(_combine_splits_kernel),
        dtypes,
    )


# ---- launches ----------------------------------------------------------------------------


def write_kv_paged(
    cache_rows: torch.Tensor,
    layer_offset: int,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` at ``meta.slot_rows``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _kernels().write_kv[(num_tokens,)](
        k,
        v,
        cache_rows,
        meta.slot_rows,
        layer_offset,
        meta.block_size,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_P=next_pow2(num_kv_heads),
        HEAD_DIM_P=next_pow2(head_dim),
    )


def paged_attention_triton(
    q: torch.Tensor,
    cache_rows: torch.Tensor,
    layer_offset: int,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Attention for every new token over the paged cache. ``q``: [tokens, heads, head_dim]."""
    paged = meta.paged
    if paged is None:
        raise ValueError("paged_attention_triton needs metadata with block tables (meta.paged)")
    if not cache_rows.is_contiguous():
        raise ValueError("the KV cache must be contiguous (block-first layout)")
    q = _last_dim_contiguous(q)
    out = torch.empty_like(q)
    window = sliding_window or 0
    for tiles, block_n, splits in (
        (paged.decode_tiles, DECODE_BLOCK_N, paged.decode_splits),
        (paged.prefill_tiles, PREFILL_BLOCK_N, 1),
    ):
        if tiles is not None and tiles.num_tiles:
            _launch_attention(
                q, out, cache_rows, layer_offset, meta, paged, tiles, scale, window, block_n, splits
            )
    return out


def _launch_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    cache_rows: torch.Tensor,
    layer_offset: int,
    meta: AttentionMetadata,
    paged: PagedInputs,
    tiles: TileSet,
    scale: float,
    sliding_window: int,
    block_n: int,
    num_splits: int,
) -> None:
    _, num_heads, head_dim = q.shape
    num_kv_heads = cache_rows.shape[1]
    group = num_heads // num_kv_heads
    compute_dtype = cache_rows.dtype
    kernels = _kernels()
    # the interpreter's dot is wrong for bf16 operands: it multiplies in fp32 instead
    dot_dtype = kernels.dtypes[torch.float32 if interpreter_enabled() else compute_dtype]
    head_dim_p = max(16, next_pow2(head_dim))
    partial, lse = out, out  # not read unless the context is split
    if num_splits > 1:
        slots = tiles.num_tiles * num_heads * num_splits  # decode tile i is token i
        partial = torch.empty(slots * head_dim_p, dtype=torch.float32, device=q.device)
        lse = torch.empty(slots, dtype=torch.float32, device=q.device)
    kernels.attention[(tiles.num_tiles, num_kv_heads, num_splits)](
        q,
        out,
        partial,
        lse,
        cache_rows,
        paged.block_tables,
        paged.context_lens,
        paged.query_starts,
        tiles.seq_ids,
        tiles.query_offsets,
        layer_offset,
        paged.rows_per_block,
        meta.block_size,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        paged.block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_P=next_pow2(group),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        KV_ALIGN=head_dim & -head_dim,
        BLOCK_Q=tiles.block_q,
        BLOCK_N=block_n,
        SLIDING_WINDOW=sliding_window,
        DOT_DTYPE=dot_dtype,
        PRECISION="ieee" if compute_dtype == torch.float32 else "tf32",
        NUM_SPLITS=num_splits,
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        kernels.combine_splits[(tiles.num_tiles, num_heads)](
            partial,
            lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_P=head_dim_p,
            NUM_SPLITS=num_splits,
            num_warps=4,
        )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
