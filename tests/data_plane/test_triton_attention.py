"""The Triton paged-attention kernels against the torch path (the reference).

Without CUDA the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``
is set here, before the kernels are first jitted); with CUDA they run compiled on the device.
Small shapes: block sizes 1/3/4/16, GQA groups 1/3/4, head_dim 8 (padded to 16) and 32,
ragged contexts, chunked prefill after cached tokens, shuffled block tables, sliding window,
fp32 and bf16, both layers of a two-layer cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from data_plane.engine.config import EngineConfig  # noqa: E402
from data_plane.engine.llm import build_engine, generate  # noqa: E402
from data_plane.engine.model_runner import (  # noqa: E402
    BatchItem,
    ModelRunner,
    PromptRows,
    resolve_attention_backend,
)
from data_plane.engine.request import Request  # noqa: E402
from data_plane.engine.sampling import SamplingParams  # noqa: E402
from data_plane.models import load_model  # noqa: E402
from data_plane.models.attention import paged_attention, write_kv  # noqa: E402
from data_plane.models.config import ModelConfig  # noqa: E402
from data_plane.models.llama import LlamaModel  # noqa: E402
from data_plane.models.paged_batch import (  # noqa: E402
    HostBatch,
    build_tiles,
    decode_splits,
    paged_metadata,
    tile_block_q,
)
from data_plane.models.staging import HostStaging  # noqa: E402
from shared.policy import Knobs  # noqa: E402
from tests.data_plane.test_duplexkv import RandomRotations  # noqa: E402

NUM_LAYERS = 2
# (tokens already cached, tokens computed now): decodes first, then prefill chunks.
SEQUENCES = [(5, 1), (17, 1), (0, 1), (40, 1), (0, 7), (9, 6), (3, 21)]


def _model(num_heads: int, num_kv_heads: int, head_dim: int) -> LlamaModel:
    config = ModelConfig(
        architecture="llama",
        vocab_size=16,
        hidden_size=num_heads * head_dim,
        intermediate_size=8,
        num_layers=NUM_LAYERS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=128,
    )
    return LlamaModel(config)


def _items(block_size: int, generator: torch.Generator) -> tuple[list[BatchItem], int]:
    """Batch items over shuffled (non-contiguous) block tables; returns them and the number
    of blocks the cache needs."""
    needed = [-(-(done + new) // block_size) for done, new in SEQUENCES]
    num_blocks = sum(needed) + 3
    free = torch.randperm(num_blocks, generator=generator).tolist()
    items = []
    for index, ((done, new), count) in enumerate(zip(SEQUENCES, needed, strict=True)):
        prompt = torch.randint(0, 16, (done + new,), generator=generator).tolist()
        request = Request(f"r{index}", prompt, SamplingParams(temperature=0), 0.0, index)
        request.num_computed_tokens = done
        items.append(BatchItem(request, new, [free.pop() for _ in range(count)]))
    return items, num_blocks


def _case(block_size: int, heads: tuple[int, int], head_dim: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(block_size * 100 + heads[0] * 10 + head_dim)
    model = _model(heads[0], heads[1], head_dim)
    runner = ModelRunner(model, block_size, "cpu", attention_backend="torch")
    items, num_blocks = _items(block_size, generator)
    _, _, ref_meta, _, _ = runner._prepare(items, PromptRows([], []))
    batch, _ = runner.host_batch(items)
    _, _, tri_meta, _ = paged_metadata(
        batch, block_size, runner.rows_per_block, heads, HostStaging(torch.device(DEVICE))
    )
    shape = (num_blocks, NUM_LAYERS, 2, block_size, heads[1], head_dim)
    cache = torch.randn(shape, generator=generator).to(dtype)
    num_tokens = sum(new for _, new in SEQUENCES)
    q = torch.randn((num_tokens, heads[0], head_dim), generator=generator).to(dtype)
    kv = torch.randn((num_tokens, 2, heads[1], head_dim), generator=generator).to(dtype)
    return cache, q, kv, ref_meta, tri_meta


def _rows(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(-1, *cache.shape[-2:])


@pytest.mark.parametrize(
    ("block_size", "heads", "head_dim", "sliding_window", "dtype"),
    [
        (1, (4, 4), 8, None, torch.float32),
        (3, (6, 2), 8, 5, torch.float32),
        (3, (6, 2), 8, None, torch.bfloat16),
        (4, (8, 2), 32, None, torch.bfloat16),
        (4, (8, 2), 32, 5, torch.float32),
        (16, (4, 1), 32, None, torch.float32),
        (16, (4, 1), 32, 5, torch.bfloat16),
    ],
)
def test_kernels_match_torch_path(
    block_size: int,
    heads: tuple[int, int],
    head_dim: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> None:
    cache, q, kv, ref_meta, tri_meta = _case(block_size, heads, head_dim, dtype)
    ref_cache, tri_cache = cache.clone(), cache.to(DEVICE)
    q_dev, kv_dev = q.to(DEVICE), kv.to(DEVICE)
    scale = head_dim**-0.5
    for layer in range(NUM_LAYERS):
        offset = 2 * layer * block_size
        # v is a strided view, as the model's split of the fused qkv projection gives it
        write_kv(_rows(ref_cache), offset, kv[:, 0], kv[:, 1], ref_meta)
        write_kv(_rows(tri_cache), offset, kv_dev[:, 0], kv_dev[:, 1], tri_meta)
        assert torch.equal(tri_cache.cpu(), ref_cache), f"layer {layer}: cache differs"
        expected = paged_attention(q, _rows(ref_cache), offset, ref_meta, scale, sliding_window)
        got = paged_attention(q_dev, _rows(tri_cache), offset, tri_meta, scale, sliding_window)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=tol, atol=tol)


def test_padded_rows_write_nothing_and_attend_to_nothing() -> None:
    """Rows a CUDA graph pads with (slot -1, context 0) leave the cache alone and give 0."""
    cache, q, kv, _, tri_meta = _case(4, (8, 2), 32, torch.float32)
    paged = tri_meta.paged
    assert paged is not None
    tri_cache = cache.to(DEVICE)
    tri_meta.slot_rows[:] = -1
    paged.context_lens[: tri_meta.num_decodes] = 0
    write_kv(_rows(tri_cache), 0, kv[:, 0].to(DEVICE), kv[:, 1].to(DEVICE), tri_meta)
    assert torch.equal(tri_cache.cpu(), cache)
    out = paged_attention(q.to(DEVICE), _rows(tri_cache), 0, tri_meta, 0.1, None)
    assert torch.count_nonzero(out[: tri_meta.num_decodes]) == 0


def test_tiles_cover_every_query_once() -> None:
    assert build_tiles([1, 5, 8], 2, 4) == ([2, 3, 3, 4, 4], [0, 0, 4, 0, 4])
    assert build_tiles([], 0, 4) == ([], [])
    assert tile_block_q(4, prefill=False) == 4  # 4 queries x 4 heads = 16 rows
    assert tile_block_q(3, prefill=True) == 16  # group 3 is padded to 4
    assert tile_block_q(32, prefill=False) == 1
    with pytest.raises(ValueError):
        build_tiles([3], 0, 0)


def _generate(path: str, backend: str, rotations: int | None = None) -> list[list[int]]:
    """Greedy tokens of the engine with ``backend`` attention (on ``DEVICE``), optionally
    with random rotations through the DuplexKV tier."""
    loaded = load_model(path, device=DEVICE, seed=3)
    config = EngineConfig(block_size=4, num_hbm_blocks=256, device=DEVICE)
    if rotations is not None:
        config = EngineConfig(
            block_size=4,
            num_hbm_blocks=24,
            num_dram_blocks=96,
            max_num_batched_tokens=8,
            device=DEVICE,
            transfer_backend="cuda" if DEVICE == "cuda" else "cpu",
        )
    engine = build_engine(loaded, config, Knobs(policy="vllm", b_xfer=16))
    runner = engine.executor.runner  # type: ignore[attr-defined]
    runner.attention_backend = resolve_attention_backend(backend, runner.device)
    if rotations is not None:
        engine.planner = RandomRotations(rotations, 0.2, 0.3)
    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    prompts = [tokenizer.encode(t) for t in ("Tim had a dog", "", "The sun was hot")]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)] * len(prompts)
    results = generate(engine, prompts, params)
    if engine.kv.has_dram:
        engine.kv.drain()
        assert engine.stats.num_rotations_out > 0
    engine.close()
    return [r.token_ids for r in results]


@pytest.mark.parametrize("model", ["tiny-random", "stories"])
def test_engine_tokens_match_torch_path_with_rotation(model: str, request) -> None:
    path = str(request.getfixturevalue("stories_path")) if model == "stories" else model
    reference = _generate(path, "torch")
    assert _generate(path, "triton", rotations=1) == reference


@pytest.mark.skipif(DEVICE == "cuda", reason="compiled for the device in the other tests")
def test_kernels_compile_for_hopper() -> None:
    """The compiled (not interpreted) path, ahead of time for sm_90 in a fresh process (the
    compiler cannot run where the interpreter has started)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("triton has no bundled ptxas to compile with")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(root / "bench" / "gpu" / "compile_check.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT compile_check kernels=9 async_copies=yes" in done.stdout


def _dense_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: list[list[int]],
    contexts: list[int],
    layer: int,
    window: int | None,
) -> torch.Tensor:
    """Each decode's attention over its whole context, gathered densely in fp64 (the
    reference for split contexts)."""
    num_kv_heads = cache.shape[4]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (table, n) in enumerate(zip(tables, contexts, strict=True)):
        if n == 0:  # an empty context attends to nothing
            out[i] = 0
            continue
        blocks = cache[torch.tensor(table), layer].double()  # [blocks, 2, bs, kvh, d]
        k = blocks[:, 0].reshape(-1, num_kv_heads, q.shape[2])[:n]
        v = blocks[:, 1].reshape(-1, num_kv_heads, q.shape[2])[:n]
        first = 0 if window is None else max(0, n - window)
        k, v = k[first:].repeat_interleave(group, 1), v[first:].repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k) * q.shape[2] ** -0.5
        out[i] = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize(
    ("splits", "window", "dtype"),
    [
        (1, None, torch.float32),
        (2, None, torch.float32),
        (4, 100, torch.float32),
        (16, None, torch.bfloat16),
    ],
)
def test_split_context_decode_matches_dense(
    splits: int, window: int | None, dtype: torch.dtype
) -> None:
    """Flash-decoding: each decode's context split over programs, combined by log-sum-exp;
    16 splits leave some empty (short contexts, a zero-length padded row)."""
    block_size, heads, head_dim, num_layers = 16, (8, 2), 32, 2
    contexts = [700, 65, 1, 300, 0]
    generator = torch.Generator().manual_seed(splits)
    num_blocks = sum(-(-n // block_size) for n in contexts) + 2
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in contexts]
    rows_per_block = num_layers * 2 * block_size
    n = len(contexts)
    batch = HostBatch(
        [0] * n,
        [max(c - 1, 0) for c in contexts],
        [-1] * n,
        [1] * n,
        contexts,
        tables,
        n,
        list(range(n)),
    )
    staging = HostStaging(torch.device(DEVICE))
    _, _, meta, _ = paged_metadata(batch, block_size, rows_per_block, heads, staging)
    assert meta.paged is not None
    meta.paged.decode_splits = splits
    cache = torch.randn(
        (num_blocks, num_layers, 2, block_size, heads[1], head_dim), generator=generator
    ).to(dtype)
    q = torch.randn((n, heads[0], head_dim), generator=generator).to(dtype)
    got = paged_attention(
        q.to(DEVICE), _rows(cache.to(DEVICE)), 2 * block_size, meta, head_dim**-0.5, window
    )
    expected = _dense_decode(q, cache, tables, contexts, 1, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().double(), expected, rtol=tol, atol=tol)


def test_split_count_fills_the_sms_and_keeps_long_splits() -> None:
    assert decode_splits(64, 8, 1024, 132) == 1  # 512 programs already fill 132 SMs
    assert decode_splits(1, 8, 4096, 132) == 16  # 8 programs: up to two per SM
    assert decode_splits(1, 8, 600, 132) == 2  # splits of >= 256 tokens
    assert decode_splits(4, 8, 8192, 132) == 8  # 32 programs x 8 = 256 >= 2 x 132
    assert decode_splits(1, 8, 4096, 0) == 1  # no SMs to fill (the interpreter)
    assert decode_splits(0, 8, 4096, 132) == 1
