"""Turns a scheduled batch into tensors, runs the model, samples the next tokens (and computes
the log-probabilities requests asked for: ``logprobs.py``).

Two attention paths (``data_plane/models/attention.py``): the torch path gathers each
sequence's context rows (the reference; the CPU path), the Triton path hands the kernels each
sequence's block table (chosen on a CUDA device when triton imports; ``attention_backend`` or
``SUPERINFER_ATTENTION_BACKEND`` = ``torch`` keeps the torch path there). On the Triton path a
batch of decodes only runs as a CUDA graph (``cuda_graphs.py``; ``cuda_graphs=False`` or
``SUPERINFER_CUDA_GRAPHS=0`` runs it eagerly); prefill chunks and mixed batches run eagerly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from data_plane.engine.batch import BatchItem, Sampled
from data_plane.engine.cuda_graphs import DEFAULT_MAX_GRAPH_BATCH, DecodeGraphs
from data_plane.engine.logprobs import token_logprobs
from data_plane.engine.request import Request
from data_plane.engine.sampler import Sampler
from data_plane.engine.sampling import SamplingRow
from data_plane.engine.structured import ends_where_grammar_ends, mask_logits
from data_plane.models.attention import AttentionMetadata
from data_plane.models.llama import LlamaModel
from data_plane.models.paged_batch import HostBatch, paged_metadata
from data_plane.models.staging import HostStaging
from data_plane.models.triton_attention import interpreter_enabled, triton_available

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


@dataclass(slots=True)
class PromptRows:
    """The logits rows (after the sampled ones) a batch computes for prompt log-probabilities:
    per request, the index of the first prompt token its rows predict and how many."""

    flat_index: list[int]  # positions in the batch's flattened tokens
    spans: list[tuple[Request, int, int]]  # (request, first predicted index, number of rows)

    def add(self, item: BatchItem, token_start: int) -> None:
        """``item``'s chunk, at ``token_start`` in the batch: rows for the prompt tokens it
        predicts, when its request asked for them and has no output yet."""
        request = item.request
        if request.params.prompt_logprobs is None or request.output_token_ids:
            return
        start = request.num_computed_tokens
        stop = min(start + item.num_tokens, len(request.prompt_token_ids) - 1)
        if stop > start:  # position p predicts prompt token p + 1
            self.flat_index.extend(range(token_start, token_start + stop - start))
            self.spans.append((request, start + 1, stop - start))


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
        self.heads = (model.config.num_heads, model.config.num_kv_heads)
        self.staging = HostStaging(self.device)  # the Triton path's step inputs
        self.graphs: DecodeGraphs | None = None
        if resolve_cuda_graphs(cuda_graphs, self.device, self.attention_backend):
            self.graphs = DecodeGraphs(model, block_size, max_graph_batch, self.device)

    def capture_graphs(self, kv_cache: torch.Tensor) -> int:
        """Capture a decode graph for every batch size now (before serving); how many."""
        if self.graphs is None:
            return 0
        self.graphs.capture_all(kv_cache)
        return self.graphs.num_captured

    def execute(self, items: list[BatchItem], kv_cache: torch.Tensor) -> Sampled:
        """Run one iteration: the sampled token of every request whose chunk reached the end
        of its known tokens, and the log-probabilities requests asked for."""
        items = sorted(items, key=lambda item: item.num_tokens != 1)  # decodes first
        prompt_rows = PromptRows([], [])
        if self.attention_backend == "triton":
            logits, sample_items = self._forward_paged(items, kv_cache, prompt_rows)
        else:
            input_ids, positions, meta, sample_items, logits_index = self._prepare(
                items, prompt_rows
            )
            logits = self.model(input_ids, positions, kv_cache, meta, logits_index)
        num_sampled = len(sample_items)
        requests = [item.request for item in sample_items]
        rows = [
            SamplingRow.of(r.params, r.prompt_token_ids, r.output_token_ids, r.stop_ids)
            for r in requests
        ]
        matchers = [r.grammar for r in requests]
        allowed = mask_logits(logits[:num_sampled], matchers)
        tokens = self.sampler.sample(allowed, ends_where_grammar_ends(allowed, matchers, rows))
        sampled = Sampled({r.request_id: t for r, t in zip(requests, tokens, strict=True)})
        _sampled_logprobs(logits[:num_sampled], requests, tokens, sampled)
        _prompt_logprobs(logits[num_sampled:], prompt_rows, sampled)
        return sampled

    def _forward_paged(
        self, items: list[BatchItem], kv_cache: torch.Tensor, prompt_rows: PromptRows
    ) -> tuple[torch.Tensor, list[BatchItem]]:
        batch, sample_items = self.host_batch(items, prompt_rows)
        if self.graphs is not None and not prompt_rows.spans and self.graphs.supports(batch):
            return self.graphs.run(batch, kv_cache), sample_items
        input_ids, positions, meta, logits_index = paged_metadata(
            batch, self.block_size, self.rows_per_block, self.heads, self.staging
        )
        return self.model(input_ids, positions, kv_cache, meta, logits_index), sample_items

    def host_batch(
        self, items: list[BatchItem], prompt_rows: PromptRows | None = None
    ) -> tuple[HostBatch, list[BatchItem]]:
        """The Triton path's inputs as host lists (``items`` sorted decodes first), and the
        items that sample, in the order of ``batch.logits_index`` (then ``prompt_rows``'
        rows, when given)."""
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
            if prompt_rows is not None:
                prompt_rows.add(item, len(batch.input_ids) - item.num_tokens)
            if end == request.num_tokens:
                sample_items.append(item)
                batch.logits_index.append(len(batch.input_ids) - 1)
        if prompt_rows is not None:
            batch.logits_index.extend(prompt_rows.flat_index)
        return batch, sample_items

    def _prepare(
        self, items: list[BatchItem], prompt_rows: PromptRows
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
            prompt_rows.add(item, token_start)
            if end == request.num_tokens:
                sample_items.append(item)
                logits_index.append(len(input_ids) - 1)
        logits_index.extend(prompt_rows.flat_index)
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
            decode_tables=tables_t,
            rows_per_block=rows_per_block,
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            sample_items,
            torch.tensor(logits_index, dtype=torch.long, device=dev),
        )


def _sampled_logprobs(
    logits: torch.Tensor, requests: list[Request], tokens: list[int], sampled: Sampled
) -> None:
    """The sampled tokens' log-probabilities, for the rows whose request asked."""
    wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not wanted:
        return
    rows = logits if len(wanted) == len(requests) else logits[wanted]
    num_top = [requests[i].params.logprobs or 0 for i in wanted]
    values = token_logprobs(rows, [tokens[i] for i in wanted], num_top)
    for j, i in enumerate(wanted):
        sampled.logprobs[requests[i].request_id] = values.slice(j, j + 1)


def _prompt_logprobs(logits: torch.Tensor, prompt_rows: PromptRows, sampled: Sampled) -> None:
    """The prompt tokens' log-probabilities, from the rows after the sampled ones."""
    row = 0
    for request, first, num in prompt_rows.spans:
        targets = request.prompt_token_ids[first : first + num]
        num_top = [request.params.prompt_logprobs or 0] * num
        values = token_logprobs(logits[row : row + num], targets, num_top)
        sampled.prompt_logprobs[request.request_id] = (first, values)
        row += num
