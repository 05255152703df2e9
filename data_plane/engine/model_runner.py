"""Turns a scheduled batch into tensors, runs the model, samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_plane.engine.request import Request
from data_plane.engine.sampling import Sampler, SamplingRow
from data_plane.models.attention import AttentionMetadata
from data_plane.models.llama import LlamaModel


@dataclass(slots=True)
class BatchItem:
    request: Request
    num_tokens: int  # tokens computed this iteration
    block_ids: list[int]  # the request's HBM block table, covering the new tokens


class ModelRunner:
    def __init__(self, model: LlamaModel, block_size: int, device: str) -> None:
        self.model = model
        self.num_layers = model.config.num_layers
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler()

    def execute(self, items: list[BatchItem], kv_cache: torch.Tensor) -> dict[str, int]:
        """Run one iteration; returns the sampled token of every request whose chunk reached
        the end of its known tokens."""
        items = sorted(items, key=lambda item: item.num_tokens != 1)  # decodes first
        input_ids, positions, meta, sample_items, logits_index = self._prepare(items)
        logits = self.model(input_ids, positions, kv_cache, meta, logits_index)
        rows = [
            SamplingRow(item.request.params, len(item.request.output_token_ids))
            for item in sample_items
        ]
        tokens = self.sampler.sample(logits, rows)
        return {item.request.request_id: t for item, t in zip(sample_items, tokens, strict=True)}

    def _prepare(
        self, items: list[BatchItem]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[BatchItem], torch.Tensor]:
        bs = self.block_size
        rows_per_block = self.num_layers * 2 * bs
        input_ids: list[int] = []
        positions: list[int] = []
        slot_rows: list[int] = []
        decode_lens: list[int] = []
        prefill: tuple[list[int], list[int], list[int], list[torch.Tensor]] = ([], [], [], [])
        sample_items: list[BatchItem] = []
        logits_index: list[int] = []
        dev = self.device
        decode_tables: list[list[int]] = []
        offsets = torch.arange(bs, device=dev)
        for item in items:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_tokens
            token_start = len(input_ids)
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = item.block_ids[: -(-end // bs)]
            slot_rows.extend(table[p // bs] * rows_per_block + p % bs for p in range(start, end))
            if item.num_tokens == 1:
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefill[0].append(token_start)
                prefill[1].append(item.num_tokens)
                prefill[2].append(start)
                table_t = torch.tensor(table, dtype=torch.long, device=dev)
                rows_t = (table_t[:, None] * rows_per_block + offsets).flatten()[:end]
                prefill[3].append(rows_t)
            if end == request.num_tokens:
                sample_items.append(item)
                logits_index.append(len(input_ids) - 1)
        width = max((len(t) for t in decode_tables), default=0)
        tables_t = torch.tensor(
            [t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long, device=dev
        ).view(len(decode_tables), width)
        decode_rows_t = (tables_t[:, :, None] * rows_per_block + offsets).view(
            len(decode_tables), width * bs
        )
        meta = AttentionMetadata(
            slot_rows=torch.tensor(slot_rows, dtype=torch.long, device=dev),
            num_decodes=len(decode_tables),
            decode_rows=decode_rows_t,
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.long, device=dev),
            prefill_query_starts=prefill[0],
            prefill_query_lens=prefill[1],
            prefill_num_computed=prefill[2],
            prefill_rows=prefill[3],
            block_size=bs,
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            sample_items,
            torch.tensor(logits_index, dtype=torch.long, device=dev),
        )
