"""CUDA graphs for decode batches: bucketing and padding (pure, on CPU), the static-buffer path
run eagerly under Triton's interpreter (CPU), and capture/replay on a device (marked gpu)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from data_plane.engine.config import EngineConfig  # noqa: E402
from data_plane.engine.cuda_graphs import (  # noqa: E402
    DecodeGraphs,
    bucket_for,
    capture_sizes,
    graph_batch_limit,
    graph_memory_bytes,
    pad_decode_batch,
    selected_rows,
    table_updates,
)
from data_plane.engine.llm import build_engine, generate  # noqa: E402
from data_plane.engine.model_runner import resolve_attention_backend  # noqa: E402
from data_plane.engine.sampling import SamplingParams  # noqa: E402
from data_plane.models import load_model  # noqa: E402
from data_plane.models.paged_batch import HostBatch, paged_metadata  # noqa: E402
from data_plane.models.staging import HostStaging  # noqa: E402
from data_plane.models.triton_attention import triton_available  # noqa: E402
from shared.policy import Knobs  # noqa: E402

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _decodes(num: int) -> HostBatch:
    return HostBatch(
        input_ids=[7 + i for i in range(num)],
        positions=[10 + i for i in range(num)],
        slot_rows=[100 + i for i in range(num)],
        query_lens=[1] * num,
        context_lens=[11 + i for i in range(num)],
        block_tables=[[i, i + 1] for i in range(num)],
        num_decodes=num,
        logits_index=list(range(num)),
    )


def test_table_updates_leave_each_row_holding_its_table() -> None:
    """Batches that grow, reorder, shrink and replace sequences: after applying the updates, the
    buffer's row i starts with table i, and a step where tables only grew writes only the
    new blocks."""
    import random

    rng = random.Random(3)
    rows, width = 6, 12
    buffer = np.full(rows * width, -1, dtype=np.int64)
    held: list[list[int]] = [[] for _ in range(rows)]
    tables = [[rng.randrange(100) for _ in range(rng.randrange(1, 5))] for _ in range(rows)]
    for step in range(60):
        if step % 7 == 3:
            rng.shuffle(tables)  # the batch reordered
        elif step % 11 == 5:
            tables[rng.randrange(rows)] = []  # a padded row
        else:
            grow = rng.randrange(rows)
            if len(tables[grow]) < width:
                tables[grow] = tables[grow] + [rng.randrange(100)]
        before = [list(t) for t in held]
        index, values = table_updates(held, tables, width)
        buffer[index] = values
        for row, table in enumerate(tables):
            assert buffer[row * width : row * width + len(table)].tolist() == table
        assert held == tables
        new_blocks = sum(
            len(t) - len(b) for t, b in zip(tables, before, strict=True) if t[: len(b)] == b
        )
        if all(t[: len(b)] == b for t, b in zip(tables, before, strict=True)):
            assert len(index) == new_blocks  # only what grew
    with pytest.raises(ValueError, match="wider than 12"):
        table_updates(held, [[0] * 13], width)


def test_graph_batch_limit_keeps_the_graphs_within_their_budget() -> None:
    config = load_model("tiny-random").config
    per_seq = graph_memory_bytes(config, 1)
    assert graph_memory_bytes(config, 64) == 64 * per_seq  # linear in the batch
    assert graph_batch_limit(config, 100, 10**12) == 100
    assert graph_batch_limit(config, 4096, 10**12) == 512  # DEFAULT_MAX_GRAPH_BATCH
    assert graph_batch_limit(config, 256, 100 * per_seq) == 96  # the largest size that fits
    assert graph_batch_limit(config, 256, per_seq // 2) == 1


def test_capture_sizes_end_at_the_largest_batch() -> None:
    assert capture_sizes(256)[:5] == (1, 2, 4, 8, 16) and capture_sizes(256)[-1] == 256
    assert capture_sizes(512)[-3:] == (384, 448, 512)
    assert capture_sizes(100)[-2:] == (96, 100)
    assert capture_sizes(1) == (1,)
    assert capture_sizes(5, candidates=(4, 2, 8)) == (2, 4, 5)
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_bucket_is_the_smallest_size_that_fits() -> None:
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 33, 64)] == [1, 4, 8, 16, 48, 64]
    assert bucket_for(65, sizes) is None
    with pytest.raises(ValueError):
        bucket_for(0, sizes)


def test_padding_adds_inert_rows() -> None:
    padded = pad_decode_batch(_decodes(3), 8)
    assert padded.num_seqs == padded.num_decodes == len(padded.input_ids) == 8
    assert padded.slot_rows[3:] == [-1] * 5  # nothing written
    assert padded.context_lens[3:] == [0] * 5  # nothing read
    assert padded.block_tables[3:] == [[]] * 5 and padded.query_lens == [1] * 8
    assert padded.input_ids[:3] == [7, 8, 9] and padded.logits_index == [0, 1, 2]
    with pytest.raises(ValueError):
        pad_decode_batch(_decodes(3), 2)
    mixed = _decodes(2)
    mixed.query_lens[1] = 4
    mixed.num_decodes = 1
    with pytest.raises(ValueError):
        pad_decode_batch(mixed, 4)


def test_selected_rows_slices_a_prefix() -> None:
    logits = torch.arange(12.0).view(6, 2)
    assert selected_rows(logits, [0, 1, 2]).data_ptr() == logits.data_ptr()  # a view
    assert selected_rows(logits, [1, 4]).tolist() == [[2.0, 3.0], [8.0, 9.0]]


def _generate(graphs: str, num_prompts: int = 3) -> tuple[list, object]:
    """Greedy tokens with the Triton path: ``graphs`` = "off" (eager), "static" (the
    static-buffer path, run eagerly), "capture" (CUDA graphs)."""
    loaded = load_model("tiny-random", device=DEVICE, seed=5)
    engine = build_engine(loaded, EngineConfig(block_size=4, num_hbm_blocks=128, device=DEVICE))
    runner = engine.executor.runner  # type: ignore[attr-defined]
    runner.attention_backend = resolve_attention_backend("triton", runner.device)
    if graphs == "off":
        runner.graphs = None
    elif graphs == "static":
        runner.graphs = DecodeGraphs(runner.model, 4, 4, runner.device, capture=False)
    prompts = [[1, 20 + i, 30 + 2 * i] * (i + 1) for i in range(num_prompts)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)] * num_prompts
    tokens = [r.token_ids for r in generate(engine, prompts, params)]
    engine.close()
    return tokens, runner.graphs


@needs_triton
def test_static_buffers_with_padding_give_the_eager_tokens() -> None:
    """3 decodes padded to a batch of 4 (5 would exceed the largest size: eager)."""
    reference, _ = _generate("off")
    tokens, graphs = _generate("static")
    assert tokens == reference
    assert graphs.num_replays > 0  # type: ignore[attr-defined]
    assert not graphs.supports(_decodes(5))  # type: ignore[attr-defined]
    assert graphs.supports(_decodes(4))  # type: ignore[attr-defined]


@pytest.mark.gpu
def test_captured_graphs_give_the_eager_tokens() -> None:
    reference, _ = _generate("off", num_prompts=5)
    tokens, graphs = _generate("capture", num_prompts=5)
    assert tokens == reference
    assert graphs.num_captured >= 2 and graphs.num_replays > 0  # type: ignore[attr-defined]


def _consistent_decodes(num: int, rows_per_block: int) -> HostBatch:
    """Sequence ``i``: 9 + i tokens cached in blocks 3i..3i+2 (block size 4), decoding one."""
    batch = HostBatch([], [], [], [], [], [], num, list(range(num)))
    for i in range(num):
        table = [3 * i, 3 * i + 1, 3 * i + 2]
        position = 9 + i - 1
        batch.input_ids.append(5 + i)
        batch.positions.append(position)
        batch.slot_rows.append(table[position // 4] * rows_per_block + position % 4)
        batch.query_lens.append(1)
        batch.context_lens.append(9 + i)
        batch.block_tables.append(table)
    return batch


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_matches_an_eager_launch(dtype: str) -> None:
    """capture_all with inert rows writes nothing; a replay (3 sequences padded to 4) gives the
    eager launch's logits and K/V; a new cache tensor is captured again."""
    model = load_model("tiny-random", dtype=dtype, device="cuda", seed=5).model
    graphs = DecodeGraphs(model, 4, 16, torch.device("cuda"))
    cache = torch.randn((16, 4, 2, 4, 2, 32), device="cuda").to(model.config.dtype)
    eager_cache, untouched = cache.clone(), cache.clone()
    graphs.capture_all(cache)
    assert graphs.num_captured == len(graphs.sizes) == 5  # 1, 2, 4, 8, 16
    assert torch.equal(cache, untouched)
    batch = _consistent_decodes(3, graphs.rows_per_block)
    replayed = graphs.run(batch, cache).float().clone()  # run() returns the shared buffer
    heads = (model.config.num_heads, model.config.num_kv_heads)
    ids, positions, meta, index = paged_metadata(
        batch, 4, graphs.rows_per_block, heads, HostStaging(cache.device)
    )
    eager = model(ids, positions, eager_cache, meta, index).float()
    tol = 1e-4 if dtype == "float32" else 2e-2
    torch.testing.assert_close(replayed, eager, rtol=tol, atol=tol * float(eager.abs().max()))
    torch.testing.assert_close(cache.float(), eager_cache.float(), rtol=tol, atol=tol)
    again = graphs.run(batch, cache.clone()).float()
    torch.testing.assert_close(again, replayed, rtol=tol, atol=tol * float(eager.abs().max()))
    assert graphs.num_captured == 1


@pytest.mark.gpu
def test_engine_on_cuda_uses_triton_and_graphs() -> None:
    engine = build_engine(
        load_model("tiny-random", device="cuda"),
        EngineConfig(block_size=4, num_hbm_blocks=64, device="cuda"),
        Knobs(policy="vllm"),
    )
    runner = engine.executor.runner  # type: ignore[attr-defined]
    assert runner.attention_backend == "triton" and runner.graphs is not None
    # every batch size up to max_num_seqs captured when the engine was built
    assert runner.graphs.num_captured == len(runner.graphs.sizes)
    assert runner.graphs.sizes[-1] == engine.max_num_seqs
    engine.close()
