"""CUDA graphs for decode iterations on the Triton attention path.

A batch of decodes only (one new token per sequence) replays a CUDA graph captured for a batch
size bucket: ``n`` sequences are padded to the smallest captured size ``>= n``. A padded row
has token 0 at position 0, slot row -1 (the Triton write kernel stores nothing for it) and
context length 0 (attention reads nothing and returns zeros); its logits are dropped. Every
graph reads static device buffers (slices of the largest bucket's): token ids, positions, slot
rows, context lengths and block tables (as wide as the model's longest context), refilled
before each replay from pinned memory (of the block tables only the entries that changed,
``table_updates``), so the block tables and positions are the graph's inputs, and writes its
logits into rows of one shared output buffer. The engine captures every bucket up to
``max_num_seqs`` when it is built (:meth:`DecodeGraphs.capture_all`, largest first, sharing one
memory pool; the KV sizing counts them, ``graph_memory_bytes``); a bucket not captured yet is
captured on first use. Prefill chunks and mixed batches run eagerly.

The bucketing and padding are pure functions (tested on CPU); ``capture=False`` runs the same
static-buffer path eagerly (the CPU tests, under Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from data_plane.models.attention import AttentionMetadata, PagedInputs, TileSet
from data_plane.models.config import ModelConfig
from data_plane.models.llama import LlamaModel
from data_plane.models.paged_batch import HostBatch, decode_splits, num_sms, tile_block_q
from data_plane.models.staging import HostStaging

DEFAULT_CAPTURE_SIZES = (
    *(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256),
    *(320, 384, 448, 512),
)
# Larger decode batches run eagerly: their step is long enough that launches do not matter
DEFAULT_MAX_GRAPH_BATCH = 512
GRAPH_MEMORY_FRACTION = 0.05  # of the device's memory, at most, for the graphs' own buffers
_WARMUP_RUNS = 2  # eager runs before a capture (Triton compiles, cuBLAS picks its kernels)
_IDS, _POSITIONS, _SLOTS, _CONTEXT = range(4)  # rows of the static vector buffer


def capture_sizes(
    max_batch: int, candidates: Sequence[int] = DEFAULT_CAPTURE_SIZES
) -> tuple[int, ...]:
    """Batch sizes to capture: the candidates below ``max_batch``, then ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return tuple(sorted({s for s in candidates if 0 < s < max_batch} | {max_batch}))


def graph_memory_bytes(config: ModelConfig, max_batch: int) -> int:
    """Device memory the captured graphs hold beyond the weights and the KV pool: the shared
    logits buffer and the private pool of the largest bucket's forward (its activations and
    its logits in the model's dtype and in fp32); an estimate from the model's shapes."""
    element = torch.tensor([], dtype=config.dtype).element_size()
    q_kv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    activations = (4 * config.hidden_size + q_kv + 3 * config.intermediate_size) * element
    logits = config.vocab_size * (element + 4)
    return max_batch * (activations + logits + config.vocab_size * 4)


def graph_batch_limit(config: ModelConfig, max_num_seqs: int, budget_bytes: int) -> int:
    """The largest decode batch to capture: ``max_num_seqs`` capped at
    ``DEFAULT_MAX_GRAPH_BATCH``, lowered to the largest capture size whose graphs fit in
    ``budget_bytes`` (``graph_memory_bytes``; at least 1)."""
    limit = min(max_num_seqs, DEFAULT_MAX_GRAPH_BATCH)
    if graph_memory_bytes(config, limit) <= budget_bytes:
        return limit
    fitting = [s for s in capture_sizes(limit) if graph_memory_bytes(config, s) <= budget_bytes]
    return fitting[-1] if fitting else 1


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest size ``>= num_seqs`` (``sizes`` ascending); None when none is."""
    if num_seqs < 1:
        raise ValueError(f"num_seqs must be >= 1, got {num_seqs}")
    return next((size for size in sizes if size >= num_seqs), None)


def is_decode_batch(batch: HostBatch) -> bool:
    return batch.num_seqs > 0 and batch.num_decodes == batch.num_seqs == len(batch.input_ids)


def pad_decode_batch(batch: HostBatch, size: int) -> HostBatch:
    """``batch`` (decodes only) padded with inert rows to ``size`` sequences."""
    if not is_decode_batch(batch):
        raise ValueError("only a batch of decodes (one token per sequence) can be padded")
    pad = size - batch.num_seqs
    if pad < 0:
        raise ValueError(f"cannot pad {batch.num_seqs} sequences down to {size}")
    return HostBatch(
        input_ids=batch.input_ids + [0] * pad,
        positions=batch.positions + [0] * pad,
        slot_rows=batch.slot_rows + [-1] * pad,
        query_lens=batch.query_lens + [1] * pad,
        context_lens=batch.context_lens + [0] * pad,
        block_tables=batch.block_tables + [[] for _ in range(pad)],
        num_decodes=size,
        logits_index=list(batch.logits_index),
    )


def table_updates(
    held: list[list[int]], tables: Sequence[list[int]], width: int
) -> tuple[np.ndarray, np.ndarray]:
    """What to write into a ``[rows, width]`` block-table buffer whose row ``i`` holds
    ``held[i]`` so that it holds ``tables[i]``: (flat indices, block ids), int64. A row whose
    table only grew (the same sequence, one more block) gets its new columns; any other change
    rewrites the row's table. Columns past a row's table are left as they are: attention never
    reads past the context. ``held`` is updated to ``tables``."""
    index: list[int] = []
    values: list[int] = []
    for row, table in enumerate(tables):
        if len(table) > width:
            raise ValueError(f"a block table is wider than {width} columns")
        old = held[row]
        kept = len(old) if len(old) <= len(table) and table[: len(old)] == old else 0
        if kept < len(table):
            base = row * width
            index.extend(range(base + kept, base + len(table)))
            values.extend(table[kept:])
            held[row] = list(table)
        elif len(old) != len(table):
            held[row] = list(table)
    return np.asarray(index, dtype=np.int64), np.asarray(values, dtype=np.int64)


def selected_rows(logits: torch.Tensor, logits_index: list[int]) -> torch.Tensor:
    """Rows ``logits_index`` of ``logits`` (a slice when they are ``0..k-1``)."""
    if logits_index == list(range(len(logits_index))):
        return logits[: len(logits_index)]
    return logits[torch.tensor(logits_index, dtype=torch.long, device=logits.device)]


@dataclass(slots=True)
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph; None when running eagerly (capture=False)
    logits: torch.Tensor | None  # the graph's output buffer


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        block_size: int,
        max_batch: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        config = model.config
        self.model = model
        self.block_size = block_size
        self.rows_per_block = config.num_layers * 2 * block_size
        self.block_q = tile_block_q(config.num_heads // config.num_kv_heads, prefill=False)
        self.num_kv_heads = config.num_kv_heads
        self.vocab_size = config.vocab_size
        self.logits: torch.Tensor | None = None  # every graph's output rows, made at capture
        self.sizes = capture_sizes(max_batch)
        max_blocks = -(-config.max_position_embeddings // block_size)
        self.max_blocks_per_seq = -(-max_blocks // 16) * 16  # as eager tables: 16-aligned
        self.capture = capture
        self.device = device
        largest = self.sizes[-1]
        self.vectors = self._longs(4, largest)  # ids, positions, slots, context lengths
        self.vectors[_SLOTS] = -1
        self.block_tables = self._longs(largest, self.max_blocks_per_seq)
        self.query_starts = torch.arange(largest + 1, dtype=torch.long, device=device)
        self.tile_seq_ids = torch.arange(largest, dtype=torch.long, device=device)
        self.tile_offsets = self._longs(largest)
        self.logits_index = torch.arange(largest, dtype=torch.long, device=device)
        self._no_rows = self._longs(0, 0)
        self._staging = HostStaging(device, capacity=4 * largest + 2 * largest * 64)
        self._tables_held: list[list[int]] = [[] for _ in range(largest)]  # block_tables' rows
        self._graphs: dict[int, _Captured] = {}
        self._pool: Any = None
        self._cache_ptr: int | None = None
        self.num_replays = 0

    def _longs(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.long, device=self.device)

    @property
    def num_captured(self) -> int:
        return sum(1 for entry in self._graphs.values() if entry.graph is not None)

    def supports(self, batch: HostBatch) -> bool:
        return (
            is_decode_batch(batch)
            and batch.num_seqs <= self.sizes[-1]
            and batch.table_width <= self.max_blocks_per_seq
        )

    def run(self, batch: HostBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Logits of the rows ``batch.logits_index``: a view of the graphs' shared output buffer,
        overwritten by the next run (of any size): read or copy it before then."""
        size = bucket_for(batch.num_seqs, self.sizes)
        if size is None or not self.supports(batch):
            raise ValueError("DecodeGraphs.run needs a decode batch that fits a captured size")
        self._use_cache(kv_cache)
        self._load(pad_decode_batch(batch, size))
        entry = self._graphs.get(size)
        if entry is None:
            entry = self._graphs[size] = self._capture(size, kv_cache)
        if entry.graph is None:
            logits = self.model(*self._inputs(size, kv_cache))
        else:
            entry.graph.replay()
            logits = entry.logits
        self.num_replays += 1
        return selected_rows(logits, batch.logits_index)

    def capture_all(self, kv_cache: torch.Tensor, max_batch: int | None = None) -> None:
        """Capture every bucket up to ``max_batch`` now (largest first), with inert inputs."""
        self._use_cache(kv_cache)
        for size in sorted(self.sizes, reverse=True):
            if size in self._graphs or (max_batch is not None and size > max_batch):
                continue
            self._load(pad_decode_batch(HostBatch([0], [0], [-1], [1], [0], [[]], 1, []), size))
            self._graphs[size] = self._capture(size, kv_cache)

    def _use_cache(self, kv_cache: torch.Tensor) -> None:
        """Graphs bake in the cache's address: a new cache tensor drops them."""
        if self._cache_ptr != kv_cache.data_ptr():
            self._graphs.clear()
            self._cache_ptr = kv_cache.data_ptr()

    def _load(self, padded: HostBatch) -> None:
        """The batch into the static input buffers: one non-blocking copy from pinned memory,
        then the vectors' device copy and a scatter of the block-table entries that changed."""
        size = padded.num_seqs
        columns = [padded.input_ids, padded.positions, padded.slot_rows, padded.context_lens]
        index, values = table_updates(
            self._tables_held, padded.block_tables, self.max_blocks_per_seq
        )
        vectors, index_dev, values_dev = self._staging.stage(
            [np.asarray(columns, dtype=np.int64), index, values]
        )
        self.vectors[:, :size].copy_(vectors)
        if index.size:
            self.block_tables.view(-1).index_copy_(0, index_dev, values_dev)

    def _inputs(
        self, size: int, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        context_lens = self.vectors[_CONTEXT, :size]
        paged = PagedInputs(
            block_tables=self.block_tables[:size],
            context_lens=context_lens,
            query_starts=self.query_starts[: size + 1],
            decode_tiles=TileSet(self.tile_seq_ids[:size], self.tile_offsets[:size], self.block_q),
            prefill_tiles=None,
            rows_per_block=self.rows_per_block,
            # from the longest context the tables hold: the graph keeps its split count
            decode_splits=decode_splits(
                size,
                self.num_kv_heads,
                self.max_blocks_per_seq * self.block_size,
                num_sms(self.device),
            ),
        )
        meta = AttentionMetadata(
            slot_rows=self.vectors[_SLOTS, :size],
            num_decodes=size,
            decode_rows=self._no_rows,
            decode_context_lens=context_lens,
            prefill_query_starts=[],
            prefill_query_lens=[],
            prefill_num_computed=[],
            prefill_rows=[],
            block_size=self.block_size,
            paged=paged,
        )
        ids, positions = self.vectors[_IDS, :size], self.vectors[_POSITIONS, :size]
        return ids, positions, kv_cache, meta, self.logits_index[:size]

    def _capture(self, size: int, kv_cache: torch.Tensor) -> _Captured:
        if not self.capture:
            return _Captured(None, None)
        args = self._inputs(size, kv_cache)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(_WARMUP_RUNS):  # writes the same K/V the replay writes
                self.model(*args)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the host pool's pinner thread may call cudaHostRegister meanwhile
        if self.logits is None:
            self.logits = torch.empty(
                (self.sizes[-1], self.vocab_size), dtype=torch.float32, device=self.device
            )
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            # into the one output buffer: the forward's own logits die with the capture, so
            # the pool's memory is reused by the next capture instead of held per size
            self.logits[:size].copy_(self.model(*args))
        self._pool = graph.pool()
        return _Captured(graph, self.logits[:size])
