"""The model's dense projections: ``nn.Linear`` whose float32 products of few rows on the CPU
go to our kernel (``cpu_dense.c``), where BLAS sgemm is slow; everything else is torch's."""

from __future__ import annotations

import torch
from torch import nn

from data_plane.models.cpu_kernels import f32_matmul

# Rows up to which the kernel beats MKL's sgemm (AMD EPYC Zen 4, 2 threads, k 512-1376, n
# 512-32000: 1.3-5x at 1-32 rows, 1.0-1.8x at 64, even to 1.3x at 128; docs/benchmarks.md)
MAX_KERNEL_ROWS = 64


class DenseLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) with a faster CPU path for few rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dim() == 2
            and x.shape[0] <= MAX_KERNEL_ROWS
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and not torch.is_grad_enabled()
        ):
            out = f32_matmul(x.contiguous(), self.weight)
            if out is not None:
                return out if self.bias is None else out.add_(self.bias)
        return super().forward(x)
