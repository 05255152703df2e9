"""``Int4BlockLinear``: 4-bit weights in the layout of our CPU kernel (``cpu_matmul.c``), used
where it is built with AVX512-VNNI; elsewhere ``quant.Int4Linear`` (torch's kernel) serves.

The kernel multiplies much as llama.cpp does its Q4 blocks: activations quantized per group of
32 (two int8 digits each), integer dot products, one float multiply-add per group and row;
prefill chunks (``DENSE_MIN_ROWS`` rows on) multiply the weight dequantized to bfloat16.
Layout (rows in blocks of 16, columns in groups of 32; ``w = q * scale + offset``, ``q`` in
0..15):
- ``codes`` [N / 16, K / 32, 4, 16, 4] uint8: per group, 4 quarters of 8 columns; row ``r``'s
  4 bytes of quarter ``c`` hold, byte ``i``, ``q[k0 + i] | q[k0 + 4 + i] << 4`` with
  ``k0 = 32 g + 8 c``;
- ``scale_bits`` [N / 16, K / 32, 2, 16]: the block's 16 scales, then 16 offsets, as the int16
  bits of bfloat16 values (so that ``model.to(dtype)`` leaves them as they are).
The same bytes per weight as torch's packing: 0.5 for the codes, 0.125 for scales and offsets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from data_plane.models.cpu_kernels import int4_dequantize, int4_matmul

BLOCK_ROWS, GROUP = 16, 32
# From this many input rows on (prefill chunks) the weight is dequantized to bfloat16 once and
# multiplied dense: 1.1-1.5x faster at 128 rows, 2-4x at 512 (the kernel's time grows per row).
DENSE_MIN_ROWS = 128


def to_kernel_layout(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale bits) in the kernel's layout from ``codes`` [N, K] in 0..15 and ``scale``,
    ``offset`` [N, K / 32]."""
    n, k = codes.shape
    if n % BLOCK_ROWS or k % GROUP:
        raise ValueError(f"int4 blocks need rows % 16 == 0 and columns % 32 == 0: {codes.shape}")
    split = codes.to(torch.uint8).view(n // BLOCK_ROWS, BLOCK_ROWS, k // GROUP, 4, 2, 4)
    nibbles = split[..., 0, :] | (split[..., 1, :] << 4)  # [blocks, row, group, quarter, byte]
    packed = nibbles.permute(0, 2, 3, 1, 4).contiguous()
    pairs = torch.stack((scale, offset)).view(2, n // BLOCK_ROWS, BLOCK_ROWS, k // GROUP)
    bits = pairs.permute(1, 3, 0, 2).to(torch.bfloat16).contiguous().view(torch.int16)
    return packed, bits


def from_kernel_layout(packed: torch.Tensor, scale_bits: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in float32 (a new tensor)."""
    num_blocks, groups = packed.shape[:2]
    n, k = num_blocks * BLOCK_ROWS, groups * GROUP
    nibbles = torch.stack((packed & 15, packed >> 4), dim=4)  # [blocks, group, quarter, row, 2, 4]
    codes = nibbles.permute(0, 3, 1, 2, 4, 5).reshape(n, groups, GROUP).float()
    pairs = scale_bits.view(torch.bfloat16).float()  # [blocks, group, 2, row]
    scale = pairs[:, :, 0].permute(0, 2, 1).reshape(n, groups, 1)
    offset = pairs[:, :, 1].permute(0, 2, 1).reshape(n, groups, 1)
    return (codes * scale + offset).view(n, k)


class Int4BlockLinear(nn.Module):
    """``x @ W.T (+ bias)`` with W held as 4-bit codes in the CPU kernel's layout."""

    codes: torch.Tensor
    scale_bits: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> None:
        """``codes`` [N, K] in 0..15; ``scale``, ``offset`` [N, K / 32]: ``w = scale * q +
        offset`` per group of 32 columns."""
        super().__init__()
        self.out_features, self.in_features = (int(size) for size in codes.shape)
        packed, bits = to_kernel_layout(codes, scale, offset)
        self.register_buffer("codes", packed)
        self.register_buffer("scale_bits", bits)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = None
        if flat.shape[0] < DENSE_MIN_ROWS:
            out = int4_matmul(flat.float().contiguous(), self.codes, self.scale_bits)
        else:
            weight = int4_dequantize(self.codes, self.scale_bits)
            if weight is not None:
                out = F.linear(flat.to(torch.bfloat16), weight)
        if out is None:  # the kernels were switched off (cpu_kernels.set_enabled)
            out = F.linear(flat.float(), self.dequantized())
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def input_dtype(self) -> torch.dtype:
        """The dtype this layer takes its input in at decode: float32 (two int8 digits
        inside)."""
        return torch.float32

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] in float32 (a new tensor each call)."""
        return from_kernel_layout(self.codes, self.scale_bits)
