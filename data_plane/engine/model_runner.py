"""Turns a scheduled batch into tensors, runs the model, samples the next tokens.

Two attention paths (``data_plane/models/attention.py``): the torch path gathers each
sequence's context rows (the reference; the CPU path), the Triton path hands the kernels each
sequence's block table (chosen on a CUDA device when triton imports; ``attention_backend`` or
``SUPERINFER_ATTENTION_BACKEND`` = ``torch`` keeps the torch path there). On the Triton path a
batch of decodes only runs as a CUDA graph (``cuda_graphs.py``; ``cuda_graphs=False`` or
``SUPERINFER_CUDA_GRAPHS=0`` runs it eagerly); prefill chunks and mixed batches run eagerly.
"""

from __future__ import annotations

import os

import torch

from data_plane.engine.batch import BatchItem
from data_plane.engine.cuda_graphs import DEFAULT_MAX_GRAPH_BATCH, DecodeGraphs
from data_plane.engine.request import Request
from data_plane.engine.sampler import Sampler
from data_plane.engine.sampling import SamplingRow
from data_plane.models.attention import AttentionMetadata
from data_plane.models.llama import LlamaModel
from data_plane.models.triton_attention import (
    HostBatch,
    interpreter_enabled,
    paged_metadata,
    triton_available,
)

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def resolve_attention_backend(requested: str | None, device: torch.device) -> str:
    """``torch`` or ``triton``: ``auto`` (the default) is Triton on a CUDA device with triton
    installed, torch otherwise. Triton on a CPU tensor needs its interpreter."""
    name = requested or os.environ.get("SUPERINFER_ATTENTION_BACKEND") or "auto"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "triton" and not triton_available():
        raise ValueError("attention backend 'triton' needs triton (pip install triton)")
    if name == "triton" and device.type != "cuda" and not interpreter_enabled():
        raise ValueError(f"attention backend 'triton' on device {device} needs TRITON_INTERPRET=1")
    return name


def resolve_cuda_graphs(requested: bool | None, device: torch.device, backend: str) -> bool:
    """CUDA graphs for decode batches: on by default on the Triton path of a CUDA device."""
    if requested is None:
        requested = os.environ.get("SUPERINFER_CUDA_GRAPHS", "1") != "0"
    return requested and backend == "triton" and device.type == "cuda"


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without concatenating the whole list."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    num_prompt = len(prompt)
    if start >= num_prompt:
        return output[start - num_prompt : end - num_prompt]
    if end <= num_prompt:
        return prompt[start:end]
    return prompt[start:] + output[: end - num_prompt]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        block_size: int,
        device: str,
        attention_backend: str | None = None,
        cuda_graphs: bool | None = None,
        max_graph_batch: int = DEFAULT_MAX_GRAPH_BATCH,
    ) -> None:
        self.model = model
        self.num_layers = model.config.num_layers
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler()
        self.attention_backend = resolve_attention_backend(attention_backend, self.device)
        self.rows_per_block = self.num_layers * 2 * block_size
        self.group_size = model.config.num_heads // model.config.num_kv_heads
        self.graphs: DecodeGraphs | None = None
        if resolve_cuda_graphs(cuda_graphs, self.device, self.attention_backend):
            self.graphs = DecodeGraphs(model, block_size, max_graph_batch, self.device)

    def execute(self, items: list[BatchItem], kv_cache: torch.Tensor) -> dict[str, int]:
        """Run one iteration; returns the sampled token of every request whose chunk reached
        the end of its known tokens."""
        items = sorted(items, key=lambda item: item.num_tokens != 1)  # decodes first
        if self.attention_backend == "triton":
            logits, sample_items = self._forward_paged(items, kv_cache)
        else:
            input_ids, positions, meta, sample_items, logits_index = self._prepare(items)
            logits = self.model(input_ids, positions, kv_cache, meta, logits_index)
        rows = [
            SamplingRow.of(r.params, r.prompt_token_ids, r.output_token_ids, r.stop_ids)
            for r in (item.request for item in sample_items)
        ]
        tokens = self.sampler.sample(logits, rows)
        return {item.request.request_id: t for item, t in zip(sample_items, tokens, strict=True)}

    def _forward_paged(
        self, items: list[BatchItem], kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, list[BatchItem]]:
        batch, sample_items = self.host_batch(items)
        if self.graphs is not None and self.graphs.supports(batch):
            return self.graphs.run(batch, kv_cache), sample_items
        input_ids, positions, meta, logits_index = paged_metadata(
            batch, self.block_size, self.rows_per_block, self.group_size, self.device
        )
        return self.model(input_ids, positions, kv_cache, meta, logits_index), sample_items

    def host_batch(self, items: list[BatchItem]) -> tuple[HostBatch, list[BatchItem]]:
        """The Triton path's inputs as host lists (``items`` sorted decodes first), and the
        items that sample, in the order of ``batch.logits_index``."""
        bs, rows_per_block = self.block_size, self.rows_per_block
        batch = HostBatch([], [], [], [], [], [], 0, [])
        sample_items: list[BatchItem] = []
        for item in items:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_tokens
            table = item.block_ids[: -(-end // bs)]
            batch.input_ids.extend(token_slice(request, start, end))
            batch.positions.extend(range(start, end))
            batch.slot_rows.extend(
                table[p // bs] * rows_per_block + p % bs for p in range(start, end)
            )
            batch.query_lens.append(item.num_tokens)
            batch.context_lens.append(end)
            batch.block_tables.append(table)
            batch.num_decodes += item.num_tokens == 1
            if end == request.num_tokens:
                sample_items.append(item)
                batch.logits_index.append(len(batch.input_ids) - 1)
        return batch, sample_items

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
