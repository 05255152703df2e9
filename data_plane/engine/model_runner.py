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
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        meta_prefill: tuple[list[int], list[int], list[int], list[torch.Tensor]] = ([], [], [], [])
        sample_items: list[BatchItem] = []
        logits_index: list[int] = []
        for item in items:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_tokens
            token_start = len(input_ids)
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            for pos in range(start, end):
                slot_blocks.append(item.block_ids[pos // bs])
                slot_offsets.append(pos % bs)
            if item.num_tokens == 1:
                decode_tables.append(item.block_ids[: -(-end // bs)])
                decode_lens.append(end)
            else:
                meta_prefill[0].append(token_start)
                meta_prefill[1].append(item.num_tokens)
                meta_prefill[2].append(start)
                table = item.block_ids[: -(-end // bs)]
                meta_prefill[3].append(torch.tensor(table, dtype=torch.long, device=self.device))
            if end == request.num_tokens:
                sample_items.append(item)
                logits_index.append(len(input_ids) - 1)
        width = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=dev),
            num_decodes=len(decode_tables),
            decode_block_tables=torch.tensor(padded, dtype=torch.long, device=dev).view(
                len(padded), width
            ),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.long, device=dev),
            prefill_query_starts=meta_prefill[0],
            prefill_query_lens=meta_prefill[1],
            prefill_num_computed=meta_prefill[2],
            prefill_block_tables=meta_prefill[3],
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            sample_items,
            torch.tensor(logits_index, dtype=torch.long, device=dev),
        )
