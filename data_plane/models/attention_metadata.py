"""The metadata of one batch's attention: where its tokens' K/V go, what each sequence attends
to, and (for the Triton path) the block tables and query tiles. Shared by the torch path
(``attention``), the Triton kernels (``triton_attention``) and the CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class TileSet:
    """Query tiles of one Triton launch: tile ``i`` holds up to ``block_q`` queries of sequence
    ``seq_ids[i]``, starting at its query ``query_offsets[i]``."""

    seq_ids: torch.Tensor  # [num_tiles]
    query_offsets: torch.Tensor  # [num_tiles]
    block_q: int

    @property
    def num_tiles(self) -> int:
        return int(self.seq_ids.shape[0])


@dataclass(slots=True)
class PagedInputs:
    """Block tables for the Triton path; sequences are ordered as the tokens are."""

    block_tables: torch.Tensor  # [num_seqs, width] HBM block ids, padded with 0
    context_lens: torch.Tensor  # [num_seqs] tokens cached after this step (new ones included)
    query_starts: torch.Tensor  # [num_seqs + 1] token index of each sequence's first query
    decode_tiles: TileSet | None
    prefill_tiles: TileSet | None
    rows_per_block: int  # num_layers * 2 * block_size
    decode_splits: int = 1  # context splits per decode (flash-decoding), a power of two


@dataclass(slots=True)
class AttentionMetadata:
    """Where this batch's tokens go and what each sequence attends to.

    Tokens are laid out decodes first (``num_decodes`` sequences, one token each), then the
    prefill chunks. Row indices are for layer 0's K (see the module docstring).
    """

    slot_rows: torch.Tensor  # [num_tokens] cache row of each new token
    num_decodes: int
    decode_rows: torch.Tensor  # [num_decodes, max_context] context rows, padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] context incl. the new token
    prefill_query_starts: list[int]  # token index where each prefill chunk starts
    prefill_query_lens: list[int]
    prefill_num_computed: list[int]  # tokens already in the cache before the chunk
    prefill_rows: list[torch.Tensor]  # [context] rows of each prefill sequence
    block_size: int
    paged: PagedInputs | None = None  # set: the Triton path (block tables, no row lists)
    # the decodes' block tables [num_decodes, width] (padded with 0) and the cache rows per
    # block (num_layers * 2 * block_size): what the CPU kernel reads the cache in place with
    decode_tables: torch.Tensor | None = None
    rows_per_block: int = 0
    # the CPU decode path's key masks by sliding window, made by the first layer that needs
    # one and shared by the others (this step's metadata only: one entry per window size)
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
