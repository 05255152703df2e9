"""One iteration's batch for the paged-attention kernels (``triton_attention``): the host lists
(:class:`HostBatch`), their query tiles and context splits, and :func:`paged_metadata`, which
stages them on the device in one copy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data_plane.models.attention_metadata import AttentionMetadata, PagedInputs, TileSet
from data_plane.models.staging import HostStaging, padded_table_array

DECODE_TILE_ROWS = 16  # rows (queries x heads of a group) of a decode tile: tl.dot's minimum
PREFILL_TILE_ROWS = 64
MAX_DECODE_SPLITS = 16
MIN_SPLIT_TOKENS = 256  # of the longest context, per split


def next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def tile_block_q(group_size: int, prefill: bool) -> int:
    """Queries per tile: a tile holds ``block_q * next_pow2(group)`` rows (at least 16)."""
    rows = PREFILL_TILE_ROWS if prefill else DECODE_TILE_ROWS
    return max(1, rows // next_pow2(group_size))


def build_tiles(query_lens: list[int], first_seq: int, block_q: int) -> tuple[list[int], list[int]]:
    """(sequence id, query offset) of every tile covering ``query_lens`` (sequence ``i`` of the
    list is sequence ``first_seq + i`` of the batch)."""
    if block_q < 1:
        raise ValueError(f"block_q must be >= 1, got {block_q}")
    seq_ids: list[int] = []
    offsets: list[int] = []
    for index, num_queries in enumerate(query_lens):
        for offset in range(0, num_queries, block_q):
            seq_ids.append(first_seq + index)
            offsets.append(offset)
    return seq_ids, offsets


@dataclass(slots=True)
class HostBatch:
    """One iteration's inputs as host lists, decodes (one token each) first."""

    input_ids: list[int]
    positions: list[int]
    slot_rows: list[int]  # layer-0 K row of each new token; -1 = write nothing
    query_lens: list[int]  # per sequence
    context_lens: list[int]  # per sequence, the new tokens included
    block_tables: list[list[int]]  # per sequence, covering its context
    num_decodes: int
    logits_index: list[int]  # token rows whose logits are sampled

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def table_width(self) -> int:
        return max((len(t) for t in self.block_tables), default=0)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere (nothing to fill)."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def decode_splits(num_decodes: int, num_kv_heads: int, max_context_len: int, sms: int) -> int:
    """Context splits per decode (flash-decoding): where a program per (decode, KV head) leaves
    SMs idle, enough splits for two programs per SM, each at least ``MIN_SPLIT_TOKENS`` of the
    longest context; a power of two, at most ``MAX_DECODE_SPLITS``. Depends on no context but
    the longest, so a CUDA graph captured for a batch size keeps it at every replay."""
    programs = num_decodes * num_kv_heads
    if programs == 0 or programs >= sms:
        return 1
    wanted = min(-(-2 * sms // programs), max_context_len // MIN_SPLIT_TOKENS, MAX_DECODE_SPLITS)
    return 1 << (max(1, wanted).bit_length() - 1)


def paged_metadata(
    batch: HostBatch,
    block_size: int,
    rows_per_block: int,
    heads: tuple[int, int],
    staging: HostStaging,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Device tensors of ``batch`` on ``staging``'s device, moved by one non-blocking copy:
    (input ids, positions, metadata, logits index). ``heads``: (query heads, KV heads)."""
    group_size = heads[0] // heads[1]
    n_dec = batch.num_decodes
    query_starts = np.zeros(batch.num_seqs + 1, dtype=np.int64)
    np.cumsum(batch.query_lens, out=query_starts[1:])
    decode_q = tile_block_q(group_size, prefill=False)
    prefill_q = tile_block_q(group_size, prefill=True)
    pre_ids, pre_offsets = build_tiles(batch.query_lens[n_dec:], n_dec, prefill_q)
    width = -(-max(1, batch.table_width) // 16) * 16  # 16-aligned: one kernel specialisation
    arrays = [
        np.asarray(values, dtype=np.int64)
        for values in (
            batch.input_ids,
            batch.positions,
            batch.slot_rows,
            batch.context_lens,
            batch.logits_index,
            pre_ids,
            pre_offsets,
        )
    ]
    arrays += [query_starts, np.arange(n_dec, dtype=np.int64), np.zeros(n_dec, dtype=np.int64)]
    arrays.append(padded_table_array(batch.block_tables, width))
    (
        ids,
        positions,
        slot_rows,
        context_lens,
        logits_index,
        pre_seq,
        pre_off,
        starts,
        dec_seq,
        dec_off,
        tables,
    ) = staging.stage(arrays)
    paged = PagedInputs(
        block_tables=tables,
        context_lens=context_lens,
        query_starts=starts,
        decode_tiles=TileSet(dec_seq, dec_off, decode_q),
        prefill_tiles=TileSet(pre_seq, pre_off, prefill_q),
        rows_per_block=rows_per_block,
        decode_splits=decode_splits(
            n_dec, heads[1], max(batch.context_lens[:n_dec], default=0), num_sms(staging.device)
        ),
    )
    meta = AttentionMetadata(
        slot_rows=slot_rows,
        num_decodes=n_dec,
        decode_rows=torch.empty((0, 0), dtype=torch.long, device=staging.device),
        decode_context_lens=context_lens[:n_dec],
        prefill_query_starts=[],
        prefill_query_lens=[],
        prefill_num_computed=[],
        prefill_rows=[],
        block_size=block_size,
        paged=paged,
    )
    return ids, positions, meta, logits_index
