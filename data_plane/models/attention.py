"""Paged attention over the block-first KV layout (the CPU reference path).

The KV cache is one tensor ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``;
layer ``l`` reads the strided view ``cache[:, l]``. Keys/values of the new tokens are written to
their slots, then each sequence attends to its context gathered through its block table:
decodes (one query each) in one padded batch, prefill chunks one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Where this batch's tokens go and what each sequence attends to.

    Tokens are laid out decodes first (``num_decodes`` sequences, one token each), then the
    prefill chunks. ``slot_blocks``/``slot_offsets`` give each new token's KV slot.
    """

    slot_blocks: torch.Tensor  # [num_tokens] physical block of each new token
    slot_offsets: torch.Tensor  # [num_tokens] offset inside that block
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] context incl. the new token
    prefill_query_starts: list[int]  # token index where each prefill chunk starts
    prefill_query_lens: list[int]
    prefill_num_computed: list[int]  # tokens already in the cache before the chunk
    prefill_block_tables: list[torch.Tensor]  # [num_blocks_of_seq] each


def write_kv(
    layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` in their slots."""
    layer_cache[:, 0][meta.slot_blocks, meta.slot_offsets] = k
    layer_cache[:, 1][meta.slot_blocks, meta.slot_offsets] = v


def paged_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Attention for every new token. ``q``: [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(q)
    n_dec = meta.num_decodes
    if n_dec:
        out[:n_dec] = _decode(q[:n_dec], layer_cache, meta, scale, sliding_window)
    for start, n_q, n_done, table in zip(
        meta.prefill_query_starts,
        meta.prefill_query_lens,
        meta.prefill_num_computed,
        meta.prefill_block_tables,
        strict=True,
    ):
        out[start : start + n_q] = _prefill(
            q[start : start + n_q], layer_cache, table, n_done, scale, sliding_window
        )
    return out


def _gather(layer_cache: torch.Tensor, tables: torch.Tensor, which: int) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_blocks * block_size, kv_heads, head_dim]."""
    gathered = layer_cache[:, which][tables]
    shape = (*tables.shape[:-1], -1, *gathered.shape[-2:])
    return gathered.reshape(shape)


def _decode(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    k = _gather(layer_cache, meta.decode_block_tables, 0)  # [n, S, kvh, d]
    v = _gather(layer_cache, meta.decode_block_tables, 1)
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    key_pos = torch.arange(k.shape[1], device=q.device)
    lens = meta.decode_context_lens.unsqueeze(1)
    mask = key_pos.unsqueeze(0) < lens
    if sliding_window is not None:
        mask &= key_pos.unsqueeze(0) > lens - 1 - sliding_window
    qg = q.view(n, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(
        qg,
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )
    return out.reshape(n, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    table: torch.Tensor,
    num_computed: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    n_q, num_heads, head_dim = q.shape
    context = num_computed + n_q
    k = _gather(layer_cache, table, 0)[:context]  # [context, kvh, d]
    v = _gather(layer_cache, table, 1)[:context]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    q_pos = torch.arange(num_computed, context, device=q.device).unsqueeze(1)
    k_pos = torch.arange(context, device=q.device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
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
