"""Paged attention over the block-first KV layout (the CPU reference path; also runs on CUDA).

The KV cache is one contiguous tensor ``(num_blocks, num_layers, 2, block_size, kv_heads,
head_dim)``. Viewed as rows of ``(kv_heads, head_dim)``, token ``o`` of block ``b`` for layer
``l`` and K/V ``kv`` is row ``((b * num_layers + l) * 2 + kv) * block_size + o``. The metadata
carries every row index for layer 0's K; layer ``l`` adds ``2 * l * block_size`` (V adds
another ``block_size``), so writing new K/V is one ``index_copy_`` and gathering a context is
one ``index_select``, with no copy of the strided per-layer view.

On the CPU the decodes' attention runs in the C kernel of ``cpu_kernels`` (``paged_decode``),
which reads each context's blocks in place through the block tables (``meta.decode_tables``);
the gather below (``_decode``) is its fallback where the kernel cannot be built, and serves
prefill chunks (whose gather is shared by their many queries). Metadata that carries block
tables for the Triton path (``meta.paged``, built for a CUDA device) sends both calls to the
kernels of ``triton_attention`` instead, which read the same layout in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from data_plane.models.attention_metadata import AttentionMetadata, PagedInputs, TileSet
from data_plane.models.cpu_kernels import paged_decode as cpu_decode
from data_plane.models.triton_attention import paged_attention_triton, write_kv_paged

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the cache dtypes the CPU kernel reads
# scaled_dot_product_attention's enable_gqa (torch >= 2.5)
_SDPA_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)

__all__ = [
    "AttentionMetadata",
    "PagedInputs",
    "TileSet",
    "paged_attention",
    "write_kv",
]


def write_kv(
    cache_rows: torch.Tensor,
    layer_offset: int,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` in their slots."""
    if meta.paged is not None:
        write_kv_paged(cache_rows, layer_offset, k, v, meta)
        return
    rows = meta.slot_rows + layer_offset
    cache_rows.index_copy_(0, rows, k)
    cache_rows.index_copy_(0, rows + meta.block_size, v)


def paged_attention(
    q: torch.Tensor,
    cache_rows: torch.Tensor,
    layer_offset: int,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Attention for every new token. ``q``: [num_tokens, num_heads, head_dim]."""
    if meta.paged is not None:
        return paged_attention_triton(q, cache_rows, layer_offset, meta, scale, sliding_window)
    n_dec = meta.num_decodes
    if 0 < n_dec == q.shape[0]:  # decodes only: no output to assemble
        return _decode_in_place(q, cache_rows, layer_offset, meta, scale, sliding_window)
    out = torch.empty_like(q)
    if n_dec:
        out[:n_dec] = _decode_in_place(
            q[:n_dec], cache_rows, layer_offset, meta, scale, sliding_window
        )
    for start, n_q, n_done, rows in zip(
        meta.prefill_query_starts,
        meta.prefill_query_lens,
        meta.prefill_num_computed,
        meta.prefill_rows,
        strict=True,
    ):
        out[start : start + n_q] = _prefill(
            q[start : start + n_q],
            cache_rows,
            rows + layer_offset,
            meta.block_size,
            n_done,
            scale,
            sliding_window,
        )
    return out


def _decode_in_place(
    q: torch.Tensor,
    cache_rows: torch.Tensor,
    layer_offset: int,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """The decodes' attention by the CPU kernel, which reads the blocks in place; where it is
    unavailable (no compiler, another device, a cache dtype it does not read), by gathering
    each context's rows (:func:`_decode`)."""
    tables = meta.decode_tables
    if (
        tables is not None
        and cache_rows.device.type == "cpu"
        and cache_rows.dtype in _KERNEL_DTYPES
    ):
        geometry = (meta.block_size, meta.rows_per_block, layer_offset)
        lens = meta.decode_context_lens
        out = cpu_decode(q, cache_rows, tables, lens, geometry, sliding_window, scale)
        if out is not None:
            return out
    rows = meta.decode_rows + layer_offset
    return _decode(q, cache_rows, rows, meta, scale, sliding_window)


def _decode(
    q: torch.Tensor,
    cache_rows: torch.Tensor,
    rows: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    width = rows.shape[1]
    k = cache_rows.index_select(0, rows.flatten()).view(n, width, -1, head_dim)
    v = cache_rows.index_select(0, (rows + meta.block_size).flatten()).view(n, width, -1, head_dim)
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    mask = meta.decode_masks.get(sliding_window)
    if mask is None:
        mask = _decode_mask(width, meta.decode_context_lens, sliding_window)
        meta.decode_masks[sliding_window] = mask
    qg = q.view(n, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(
        qg,
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
    )
    return out.reshape(n, num_heads, head_dim)


def _decode_mask(width: int, lens: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[n, 1, 1, width]: which of the padded context rows each decode attends to."""
    key_pos = torch.arange(width, device=lens.device).unsqueeze(0)
    lens = lens.unsqueeze(1)
    mask = key_pos < lens
    if sliding_window is not None:
        mask &= key_pos > lens - 1 - sliding_window
    return mask[:, None, None, :]


def _prefill(
    q: torch.Tensor,
    cache_rows: torch.Tensor,
    rows: torch.Tensor,
    block_size: int,
    num_computed: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    n_q, num_heads, head_dim = q.shape
    context = num_computed + n_q
    k = cache_rows.index_select(0, rows[:context])  # [context, kvh, d]
    v = cache_rows.index_select(0, rows[:context] + block_size)
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    mask: torch.Tensor | None = None
    if num_computed or sliding_window is not None:
        q_pos = torch.arange(num_computed, context, device=q.device).unsqueeze(1)
        k_pos = torch.arange(context, device=q.device).unsqueeze(0)
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
    if _SDPA_GQA:
        # [1, heads, tokens, d] with the KV heads shared by groups: torch's fused (flash) CPU
        # kernel, causal without a mask for a first chunk (2-6x the masked 3-D call, measured)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
    if mask is None:
        mask = torch.ones(n_q, context, dtype=torch.bool, device=q.device).tril()
    # [kvh, group * n_q, d]: every query head of a KV group attends to that group's keys.
    qg = q.view(n_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * n_q, head_dim)
    out = F.scaled_dot_product_attention(
        qg,
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask.repeat(group, 1),
        scale=scale,
    )
    out = out.view(num_kv_heads, group, n_q, head_dim).permute(2, 0, 1, 3)
    return out.reshape(n_q, num_heads, head_dim)
