"""The int8 kernel's layout and ``int8_matmul`` (cpu_matmul.c) against plain float64 products
of the same int8 weights."""

from __future__ import annotations

import pytest
import torch

from data_plane.models import cpu_kernels, int8_blocks
from data_plane.models.quant import Int8Embedding, int8_linear, int8_rows

needs_kernel = pytest.mark.skipif(
    not cpu_kernels.int4_available(), reason="no AVX512-VNNI kernel on this host"
)


def _codes(n: int, k: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int16)
    codes[0, :3] = torch.tensor([-127, 127, 0])  # the extremes and zero
    return codes.to(torch.int8)


def test_the_layout_holds_every_code_and_rows_are_looked_up() -> None:
    codes = _codes(48, 96)
    packed = int8_blocks.to_kernel_layout(codes)
    assert packed.shape == (3, 3, 8, 16, 4) and packed.dtype == torch.uint8
    assert torch.equal(int8_blocks.from_kernel_layout(packed), codes)
    ids = torch.tensor([[0, 47, 16], [15, 17, 31]])
    assert torch.equal(int8_blocks.rows(packed, ids), codes[ids].to(torch.int16))
    # byte i of row r's lane for eighth c of group g is column 32 g + 4 c + i, plus 128
    assert int(packed[1, 2, 5, 3, 1]) == int(codes[16 + 3, 64 + 20 + 1]) + 128
    with pytest.raises(ValueError, match="rows % 16"):
        int8_blocks.to_kernel_layout(codes[:40])


def _activation_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel's error bound: each activation off by at most half a fine step (its group's
    max |x| / 127 / 254 / 2), times |w|, plus float32 accumulation."""
    m, k = x.shape
    step = x.abs().view(m, k // 32, 32).amax(dim=2) / 127 / 254 / 2  # [m, groups]
    per_group = weight.abs().view(weight.shape[0], k // 32, 32).sum(dim=2)  # [n, groups]
    accumulate = 1e-6 * (x.abs() @ weight.abs().T)
    return step @ per_group.T * 1.01 + accumulate


@needs_kernel
@pytest.mark.parametrize("m", [1, 7, 8, 9, 130])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 96), (64, 576)])
def test_kernel_within_its_activation_rounding(m: int, n: int, k: int) -> None:
    torch.manual_seed(m * 1000 + k)
    weight = torch.randn(n, k) * torch.rand(n, 1) * 3
    x = torch.randn(m, k) * torch.rand(1, k) * 4
    x[0, 5] = 80.0  # an outlier: its group's step is coarse, the others' are not
    layer = int8_linear(weight)
    assert isinstance(layer, int8_blocks.Int8BlockLinear)
    codes, scales = int8_rows(weight)
    dequantized = codes.double() * scales.to(torch.bfloat16).double()[:, None]
    want = x.double() @ dequantized.T
    got = layer(x).double()
    assert ((got - want).abs() <= _activation_bound(x.double(), dequantized)).all()


@needs_kernel
def test_switched_off_the_layer_multiplies_its_dequantized_weight() -> None:
    weight = torch.randn(32, 64)
    layer = int8_linear(weight)
    x = torch.randn(3, 64)
    want = x @ layer.dequantized().T
    cpu_kernels.set_enabled(False)
    try:
        got = layer(x)
    finally:
        cpu_kernels.set_enabled(True)
    torch.testing.assert_close(got, want)


@needs_kernel
def test_the_embedding_shares_the_kernels_bytes_with_a_tied_head() -> None:
    codes = _codes(64, 96, seed=1)
    scales = torch.rand(64) + 0.01
    embedding = Int8Embedding(codes, scales, torch.float32)
    assert embedding.blocked
    ids = torch.tensor([[3, 63], [0, 17]])
    want = codes[ids].float() * scales.to(torch.bfloat16).float()[ids][..., None]
    assert torch.equal(embedding(ids), want)
    head = embedding.as_linear()
    assert isinstance(head, int8_blocks.Int8BlockLinear) and head.codes is embedding.codes


def test_a_nan_activation_gives_nan_outputs_as_a_plain_matmul() -> None:
    """The kernel quantizes each row's groups of 32: a NaN was dropped from the group's
    maximum and cast to a code (undefined in C), and the row came out finite, hiding the NaN
    from everything after the lm_head."""
    torch.manual_seed(0)
    codes, scales = int8_rows(torch.randn(32, 64))
    layout = int8_blocks.to_kernel_layout(codes)
    head = int8_blocks.Int8BlockLinear(layout, scales.to(torch.bfloat16).view(torch.int16))
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    x[2, 32:] = float("nan")  # a whole group
    reference = x @ head.dequantized().T
    out = head(x)
    assert out[0].isfinite().all() and not out[1:].isfinite().any()
    assert torch.equal(out.isnan(), reference.isnan())
