"""The fused Triton kernels (RMSNorm + residual, RoPE + K/V write, SiLU x up) against
transformers' own modules (LlamaRMSNorm, apply_rotary_pos_emb, the SiLU activation), and the
launches of a decode layer on the Triton path.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``
set here, before they are first jitted). Shapes: Llama-3-8B's heads (32 / 8, head_dim 128),
Qwen2's GQA 7 (14 / 2, 64), no GQA (4 / 4, head_dim 8), block sizes 16 and 32, fp32 / bf16 /
fp16.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
modeling = pytest.importorskip("transformers.models.llama.modeling_llama")

from data_plane.models import triton_fused  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _assert_sum(got: torch.Tensor, want: torch.Tensor) -> None:
    """One rounding of an fp32 sum: equal, except that the interpreter's fp32 -> bf16 cast
    truncates where the GPU rounds to nearest (one bf16 step apart at most)."""
    if got.dtype == torch.bfloat16 and DEVICE == "cpu":
        torch.testing.assert_close(got, want, atol=1e-6, rtol=2**-7)
    else:
        assert torch.equal(got, want)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    """Three steps of the dtype apart at most (a row's reduction order, and on the CPU the
    interpreter's truncating bf16 casts)."""
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2.4e-2}[dtype]
    return {"atol": rtol, "rtol": rtol}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, hidden: int) -> None:
    generator = torch.Generator().manual_seed(hidden)
    norm = modeling.LlamaRMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=generator) * 0.5 + 1
    norm = norm.to(dtype)
    x = (torch.randn(7, hidden, generator=generator) * 3).to(dtype)
    residual = torch.randn(7, hidden, generator=generator).to(dtype)
    weight = norm.weight.data.to(DEVICE)

    out, stream = triton_fused.rms_norm(x.to(DEVICE), None, weight, 1e-5)
    torch.testing.assert_close(out.cpu(), norm(x), **_tol(dtype))
    assert torch.equal(stream.cpu(), x)

    total = residual + x  # transformers' residual add, in the model's dtype
    residual_dev = residual.to(DEVICE)
    out, stream = triton_fused.rms_norm(x.to(DEVICE), residual_dev, weight, 1e-5)
    assert stream is residual_dev  # the sum written in place
    _assert_sum(stream.cpu(), total)
    torch.testing.assert_close(out.cpu(), norm(total), **_tol(dtype))


def _cos_sin(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    freqs = torch.outer(positions.double(), inv_freq)
    return freqs.cos().float(), freqs.sin().float()


@pytest.mark.parametrize(
    ("heads", "head_dim", "block_size", "dtype"),
    [
        ((32, 8), 128, 16, torch.bfloat16),
        ((14, 2), 64, 32, torch.float16),
        ((4, 4), 8, 16, torch.float32),
        ((32, 8), 128, 32, torch.float32),
    ],
)
def test_rope_write_kv_against_transformers(
    heads: tuple[int, int], head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    num_heads, num_kv_heads = heads
    num_tokens, num_layers, num_blocks = 6, 2, 9
    generator = torch.Generator().manual_seed(head_dim + num_heads)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=generator).to(dtype)
    positions = torch.tensor([0, 5, 17, 300, 1023, 4096])
    cos, sin = _cos_sin(positions, head_dim)
    rows_per_block = num_layers * 2 * block_size
    cache = torch.zeros(num_blocks * rows_per_block, num_kv_heads, head_dim, dtype=dtype)
    blocks = torch.randperm(num_blocks, generator=generator)[:num_tokens].tolist()
    slots = [b * rows_per_block + t for t, b in enumerate(blocks)]
    slots[2] = -1  # a padded row: rotated, written nowhere
    layer = 1
    offset = 2 * layer * block_size

    cache_dev, qkv_dev = cache.clone().to(DEVICE), qkv.clone().to(DEVICE)
    slot_rows = torch.tensor(slots, device=DEVICE)
    rope = (cos.to(DEVICE)[:, None], sin.to(DEVICE)[:, None])
    heads3 = (num_heads, num_kv_heads, head_dim)
    q = triton_fused.rope_write_kv(
        qkv_dev, heads3, rope, cache_dev, slot_rows, (offset, block_size)
    )

    q_ref, k_ref, v_ref = qkv.split(
        (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1
    )
    # transformers' layout: [batch, heads, tokens, head_dim], cos/sin over the whole head
    full_cos, full_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    q_rot, k_rot = modeling.apply_rotary_pos_emb(
        q_ref.view(1, num_tokens, num_heads, head_dim).transpose(1, 2).float(),
        k_ref.view(1, num_tokens, num_kv_heads, head_dim).transpose(1, 2).float(),
        full_cos,
        full_sin,
    )
    torch.testing.assert_close(q.cpu(), q_rot[0].transpose(0, 1).to(dtype), **_tol(dtype))
    assert q.data_ptr() == qkv_dev.data_ptr()  # rotated in place, a view of qkv
    expected = cache.clone()
    k_tokens = k_rot[0].transpose(0, 1).to(dtype)
    for token, slot in enumerate(slots):
        if slot >= 0:
            expected[slot + offset] = k_tokens[token]
            expected[slot + offset + block_size] = v_ref[token].view(num_kv_heads, head_dim)
    torch.testing.assert_close(cache_dev.cpu(), expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [8, 1376, 2 * triton_fused.SILU_BLOCK + 3])
def test_silu_and_mul_against_transformers(dtype: torch.dtype, width: int) -> None:
    from transformers.activations import ACT2FN

    generator = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(5, 2 * width, generator=generator) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = ACT2FN["silu"](gate) * up
    got = triton_fused.silu_and_mul(gate_up.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expected, **_tol(dtype))


def test_empty_batches_launch_nothing() -> None:
    x = torch.empty(0, 16, device=DEVICE)
    out, stream = triton_fused.rms_norm(x, None, torch.ones(16, device=DEVICE), 1e-6)
    assert out.shape == (0, 16) and stream is x
    assert triton_fused.silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)
