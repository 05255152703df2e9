"""int8 weights (one scale per output row: the lm_head, the token embedding) in the layout of
the CPU kernel ``int8_matmul`` (``cpu_matmul.c``): output rows in blocks of 16, input columns
in groups of 32, each group in eight 4-column eighths, a 32-bit lane per row; the codes are
stored plus 128 (unsigned, as VNNI multiplies them). The embedding looks its rows up in the
same bytes, so a tied lm_head costs nothing more."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from data_plane.models.cpu_kernels import int4_available, int8_matmul

BLOCK_ROWS, GROUP = 16, 32


def supported(n: int, k: int) -> bool:
    """Whether an [n, k] int8 weight takes the kernel's layout here."""
    return n % BLOCK_ROWS == 0 and k % GROUP == 0 and int4_available()


def to_kernel_layout(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` [N, K] int8 (-127..127) as the kernel's bytes [N / 16, K / 32, 8, 16, 4]."""
    n, k = codes.shape
    if n % BLOCK_ROWS or k % GROUP:
        raise ValueError(f"int8 blocks need rows % 16 == 0 and columns % 32 == 0: {codes.shape}")
    shifted = (codes.to(torch.int16) + 128).to(torch.uint8)
    split = shifted.view(n // BLOCK_ROWS, BLOCK_ROWS, k // GROUP, 8, 4)
    return split.permute(0, 2, 3, 1, 4).contiguous()


def rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the int8 codes, as int16 [*ids.shape, K]."""
    flat = ids.flatten()
    picked = packed[flat // BLOCK_ROWS, :, :, flat % BLOCK_ROWS]  # [len, K / 32, 8, 4]
    return (picked.reshape(*ids.shape, -1).to(torch.int16)) - 128


def from_kernel_layout(packed: torch.Tensor) -> torch.Tensor:
    """All the codes, int8 [N, K] (a new tensor)."""
    n = packed.shape[0] * BLOCK_ROWS
    return rows(packed, torch.arange(n)).to(torch.int8)


class Int8BlockLinear(nn.Module):
    """``x @ W.T (+ bias)`` with W held as int8 codes in the CPU kernel's layout and one scale
    per output row (bfloat16 bits)."""

    codes: torch.Tensor
    scale_bits: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, packed: torch.Tensor, scale_bits: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        """``packed`` from :func:`to_kernel_layout`; ``scale_bits`` [N] int16 (bfloat16 bits)."""
        super().__init__()
        num_blocks, groups = packed.shape[:2]
        self.out_features, self.in_features = num_blocks * BLOCK_ROWS, groups * GROUP
        self.register_buffer("codes", packed)
        self.register_buffer("scale_bits", scale_bits)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel at every row count: at 128 and 512 rows (a 49,152 x 576 lm_head) it takes
        # 0.15x and 0.57x the time of expanding the weight and one bfloat16 matmul.
        flat = x.reshape(-1, self.in_features)
        out = int8_matmul(flat.float().contiguous(), self.codes, self.scale_bits)
        if out is None:  # the kernels were switched off (cpu_kernels.set_enabled)
            out = F.linear(flat.float(), self.dequantized())
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def input_dtype(self) -> torch.dtype:
        """The dtype this layer takes its input in: float32 (two int8 digits inside)."""
        return torch.float32

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in ``dtype`` (a new tensor each call)."""
        scales = self.scale_bits.view(torch.bfloat16).to(dtype).unsqueeze(1)
        return from_kernel_layout(self.codes).to(dtype) * scales
