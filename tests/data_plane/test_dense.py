"""The float32 matmul of few rows (data_plane/models/cpu_dense.c) and DenseLinear, against
torch's product in float64."""

from __future__ import annotations

import pytest
import torch

from data_plane.models import cpu_kernels
from data_plane.models.dense import MAX_KERNEL_ROWS, DenseLinear

pytestmark = pytest.mark.skipif(
    cpu_kernels.kernels() is None or not cpu_kernels.kernels().f32_matmul_available(),  # type: ignore[union-attr]
    reason="the dense kernel does not compute here (no compiler or no AVX-512)",
)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 15, 33, 64])
@pytest.mark.parametrize(("n", "k"), [(1, 16), (3, 7), (17, 33), (770, 512), (2752, 1376)])
def test_matches_a_float64_product(m: int, n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=generator)
    weight = torch.randn(n, k, generator=generator)
    expected = (x.double() @ weight.double().T).float()
    got = cpu_kernels.f32_matmul(x, weight)
    assert got is not None
    tolerance = 1e-5 * k**0.5 * float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)


def test_refuses_what_it_does_not_compute() -> None:
    weight = torch.randn(8, 16)
    assert cpu_kernels.f32_matmul(torch.randn(2, 16).bfloat16(), weight) is None
    assert cpu_kernels.f32_matmul(torch.randn(16, 2).T, weight) is None  # not contiguous
    with pytest.raises(ValueError, match="does not match"):
        cpu_kernels.f32_matmul(torch.randn(2, 15), weight)


@pytest.mark.parametrize("rows", [1, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1])
def test_dense_linear_with_bias_matches_torch(rows: int) -> None:
    torch.manual_seed(rows)
    layer = DenseLinear(96, 40, bias=True)
    x = torch.randn(rows, 96)
    expected = (x.double() @ layer.weight.double().T + layer.bias.double()).float()
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.enable_grad():  # training keeps torch's autograd path
        assert layer(x).requires_grad
