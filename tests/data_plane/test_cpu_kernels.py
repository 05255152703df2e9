"""The CPU kernels (data_plane/models/cpu_attention.c) against plain torch references built
here from the cache's layout (not from the model's attention code)."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch

from data_plane.models import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.decode_kernel() is None, reason="no C compiler: the torch path serves"
)

NUM_LAYERS, BLOCK_SIZE = 3, 16


def _reference_decode(q, cache, tables, lens, layer, window, scale):
    """Per sequence and head: softmax(q . K^T * scale) V over the context's tokens, read from
    the 6-D cache (num_blocks, layers, 2, block_size, kv_heads, head_dim) token by token."""
    n, num_heads, _ = q.shape
    group = num_heads // cache.shape[4]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n):
        length = int(lens[i])
        first = max(0, length - window) if window else 0
        positions = range(first, length)
        keys = torch.stack(
            [cache[tables[i, p // BLOCK_SIZE], layer, 0, p % BLOCK_SIZE] for p in positions]
        )
        values = torch.stack(
            [cache[tables[i, p // BLOCK_SIZE], layer, 1, p % BLOCK_SIZE] for p in positions]
        )
        for h in range(num_heads):
            k, v = keys[:, h // group].double(), values[:, h // group].double()
            weights = torch.softmax(k @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ v
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32)])
@pytest.mark.parametrize("window", [None, 21])
def test_decode_reads_the_blocks_in_place(dtype, num_heads, num_kv_heads, head_dim, window):
    gen = torch.Generator().manual_seed(num_heads * 7 + head_dim)
    num_blocks = 40
    shape = (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(dtype)
    lens = torch.tensor([1, 17, 70, 33])  # one token, a block boundary, several blocks
    width = math.ceil(int(lens.max()) / BLOCK_SIZE)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    layer, scale = 1, head_dim**-0.5
    rows = cache.view(-1, num_kv_heads, head_dim)
    geometry = (BLOCK_SIZE, NUM_LAYERS * 2 * BLOCK_SIZE, 2 * layer * BLOCK_SIZE)
    got = cpu_kernels.paged_decode(q, rows, tables, lens, geometry, window, scale)
    assert got is not None and got.dtype == dtype and got.shape == q.shape
    want = _reference_decode(q, cache, tables, lens, layer, window, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


def test_decode_split_over_threads_matches() -> None:
    """Enough context to split the sequences over threads (16,384 tokens x heads each)."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, num_heads, num_kv_heads, head_dim = 400, 8, 2, 32
    shape = (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen)
    lens = torch.tensor([900, 1200, 5, 2100, 700, 1000])
    width = math.ceil(int(lens.max()) / BLOCK_SIZE)
    tables = torch.randint(0, num_blocks, (len(lens), width), generator=gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    geometry = (BLOCK_SIZE, NUM_LAYERS * 2 * BLOCK_SIZE, 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        got = cpu_kernels.paged_decode(q, cache.view(-1, 2, 32), tables, lens, geometry, None, 0.2)
    finally:
        torch.set_num_threads(threads)
    want = _reference_decode(q, cache, tables, lens, 0, None, 0.2)
    assert got is not None
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_decode_refuses_a_cache_it_would_misread() -> None:
    """The kernel reads float32 or bfloat16: a float16 cache was read as float32 (past its
    end); tables or lengths not one per query row read past theirs."""
    if cpu_kernels.decode_kernel() is None:
        pytest.skip("no C compiler: the torch path serves")
    q = torch.randn(2, 2, 32)
    tables, lens = torch.zeros(2, 1, dtype=torch.long), torch.tensor([3, 3])
    geometry = (BLOCK_SIZE, NUM_LAYERS * 2 * BLOCK_SIZE, 0)
    cache = torch.randn(4 * NUM_LAYERS * 2 * BLOCK_SIZE, 2, 32)
    with pytest.raises(ValueError, match="float16"):
        cpu_kernels.paged_decode(q, cache.half(), tables, lens, geometry, None, 0.2)
    with pytest.raises(ValueError, match="one block table"):
        cpu_kernels.paged_decode(q, cache, tables[:1], lens, geometry, None, 0.2)


def test_a_failed_build_is_reported_not_raised(monkeypatch, tmp_path) -> None:
    """Without a working compiler the loader says why and the torch path serves."""
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises((OSError, subprocess.SubprocessError)):
        cpu_kernels._build()
    monkeypatch.setattr(cpu_kernels, "PREBUILT", tmp_path / "absent.so")
    assert cpu_kernels._load() is None


def test_the_prebuilt_library_serves_without_a_compiler(monkeypatch, tmp_path) -> None:
    """The container image's build (no compiler at run time) is loaded instead."""
    built = cpu_kernels._build()  # this host's, standing in for the image's
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "PREBUILT", built)
    assert cpu_kernels._load() is not None


def test_rms_norm_with_and_without_the_residual_add() -> None:
    gen = torch.Generator().manual_seed(3)
    x, residual = torch.randn(5, 96, generator=gen), torch.randn(5, 96, generator=gen)
    weight, eps = torch.randn(96, generator=gen), 1e-5

    def reference(v: torch.Tensor) -> torch.Tensor:
        v = v.double()
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.double()

    got = cpu_kernels.rms_norm(x, None, weight, eps)
    assert got is not None
    torch.testing.assert_close(got.double(), reference(x), atol=1e-5, rtol=1e-5)
    total = x.double() + residual.double()
    stream = residual.clone()
    got = cpu_kernels.rms_norm(x, stream, weight, eps)
    assert got is not None
    torch.testing.assert_close(stream.double(), total, atol=1e-6, rtol=1e-6)  # updated in place
    torch.testing.assert_close(got.double(), reference(total), atol=1e-5, rtol=1e-5)
    assert cpu_kernels.rms_norm(x.bfloat16(), None, weight, eps) is None  # float32 only


def test_rope_rotates_q_and_k_and_stores_k_and_v() -> None:
    """Half-rotation RoPE: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) per head."""
    gen = torch.Generator().manual_seed(4)
    n, num_q, num_kv, head_dim = 3, 4, 2, 8
    qkv = torch.randn(n, (num_q + 2 * num_kv) * head_dim, generator=gen)
    angles = torch.rand(n, 1, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    cache = torch.zeros(4, NUM_LAYERS, 2, BLOCK_SIZE, num_kv, head_dim)
    rows = cache.view(-1, num_kv, head_dim)
    layer, slots = 2, [(1, 3), (3, 0), (0, 15)]  # (block, offset) of each token
    rows_per_block = NUM_LAYERS * 2 * BLOCK_SIZE
    slot_rows = torch.tensor([b * rows_per_block + o for b, o in slots])
    before = qkv.clone().view(n, -1, head_dim)
    done = cpu_kernels.rope_write_kv(
        qkv,
        (num_q, num_kv, head_dim),
        (cos, sin),
        rows,
        slot_rows,
        (2 * layer * BLOCK_SIZE, BLOCK_SIZE),
    )
    assert done
    x1, x2 = before[:, : num_q + num_kv].chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    after = qkv.view(n, -1, head_dim)
    torch.testing.assert_close(after[:, : num_q + num_kv], rotated)
    torch.testing.assert_close(after[:, num_q + num_kv :], before[:, num_q + num_kv :])
    for j, (block, offset) in enumerate(slots):
        torch.testing.assert_close(cache[block, layer, 0, offset], rotated[j, num_q:])
        torch.testing.assert_close(cache[block, layer, 1, offset], before[j, num_q + num_kv :])
    assert int(cache.count_nonzero()) == 2 * n * num_kv * head_dim  # nothing else written
