"""Weight-only quantized layers for the CPU: weights stay 4- or 8-bit in memory and kernels read
them directly: for int4 ours (``cpu_matmul.c``, in ``int4_blocks.Int4BlockLinear``'s layout)
where the library is built with AVX512-VNNI, else torch's (``_weight_int4pack_mm_for_cpu``);
for int8 ours (``int8_blocks.Int8BlockLinear``) where that kernel computes, else torch's
(``_weight_int8pack_mm``).

Torch's kernels take bfloat16 activations (their float32 paths are 25-80x slower here,
bench/quant_matmul.py), so a quantized layer computes in bfloat16 and returns the caller's
dtype, as llama.cpp rounds activations to 8 bits for its quantized dot products. Ours takes
float32 activations as two int8 digits per value (~15 bits).

- ``Int4Linear``: groups of ``group_size`` weights along the input, ``w = (q - 8) * scale +
  zero`` with ``q`` in 0..15 (tinygemm's form); GGUF Q4_0, Q4_1 and Q4_K map onto it exactly
  (up to the scales' rounding to bfloat16). The int4 kernel's time grows with every row of
  input (it re-reads the weights per row), so from ``DENSE_MIN_ROWS`` rows on (prefill chunks)
  the layer dequantizes its packed codes to a transient bfloat16 weight and runs a dense
  matmul instead: 2x faster at 1,024 rows. The packing's layout (which depends on the CPU's
  vector width) is checked against the codes at load; where it is not the one expected, the
  codes are kept a second time as plain nibbles for that.
- ``Int8Linear``: one scale per output row, ``w = q * scale``; other quantized GGUF types are
  re-quantized to it from their dequantized values.
- ``Int8Embedding``: the same rows looked up; a tied lm_head shares its codes.

Scales are held as the int16 bit patterns of their bfloat16 values, so that casting the
model's float tensors (``model.to(dtype)``) leaves the kernels' inputs as they need them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from data_plane.models.cpu_kernels import int4_available
from data_plane.models.int4_blocks import Int4BlockLinear
from data_plane.models.int8_blocks import Int8BlockLinear, supported, to_kernel_layout
from data_plane.models.int8_blocks import rows as block_rows

COMPUTE_DTYPE = torch.bfloat16
INT4_GROUP = 32
INT4_N_MULTIPLE = 16  # the CPU packing's requirement on the output rows
DENSE_MIN_ROWS = 128  # Int4Linear: from this many input rows on, dequantize and run dense


def int4_supported(out_features: int, in_features: int) -> bool:
    return out_features % INT4_N_MULTIPLE == 0 and in_features % INT4_GROUP == 0


class Int4Linear(nn.Module):
    """``x @ W.T (+ bias)`` with W held as packed 4-bit codes and per-group scale/zero."""

    packed: torch.Tensor
    scale_zero_bits: torch.Tensor
    bias: torch.Tensor | None
    nibbles: torch.Tensor | None

    def __init__(
        self,
        codes: torch.Tensor,
        scale_zeros: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> None:
        """``codes`` [N, K] in 0..15; ``scale_zeros`` [K / group, N, 2] (tinygemm's)."""
        super().__init__()
        self.out_features, self.in_features = (int(size) for size in codes.shape)
        self.group_size = self.in_features // int(scale_zeros.shape[0])
        codes = codes.to(torch.uint8)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero_bits", _bits(scale_zeros))
        self.register_buffer("bias", bias)
        self.half_block = _int4_layout_half_block(packed, codes)
        nibbles = None if self.half_block else codes[:, 0::2] | (codes[:, 1::2] << 4)
        self.register_buffer("nibbles", nibbles)  # only when the packing's layout is unknown

    def input_dtype(self) -> torch.dtype:
        """The dtype this layer multiplies in: torch's kernel's bfloat16."""
        return COMPUTE_DTYPE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        scale_zeros = self.scale_zero_bits.view(COMPUTE_DTYPE)
        if flat.shape[0] >= DENSE_MIN_ROWS:
            out = F.linear(flat, self.dequantized())
        else:
            out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, scale_zeros)
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] in bfloat16 (a new tensor each call)."""
        n, k, group = self.out_features, self.in_features, self.group_size
        scale_zeros = self.scale_zero_bits.view(COMPUTE_DTYPE)  # [K / group, N, 2]
        scale, zero = scale_zeros[..., 0], scale_zeros[..., 1]
        half, nibbles = self.half_block, self.nibbles
        if nibbles is None:  # packed [N / 2h, K, h]: a block's row j low, row h + j high
            codes = torch.empty(n // (2 * half), 2, half, k, dtype=torch.uint8)
            blocks = self.packed.view(-1, k, half).transpose(1, 2)
            torch.bitwise_and(blocks, 15, out=codes[:, 0])
            torch.bitwise_right_shift(blocks, 4, out=codes[:, 1])
        else:
            codes = torch.empty(n, k // 2, 2, dtype=torch.uint8)
            torch.bitwise_and(nibbles, 15, out=codes[..., 0])
            torch.bitwise_right_shift(nibbles, 4, out=codes[..., 1])
        scale = scale.t().unsqueeze(-1)  # [N, K / group, 1]
        weight = codes.view(n, k // group, group).to(COMPUTE_DTYPE)
        return weight.mul_(scale).add_(zero.t().unsqueeze(-1) - 8 * scale).view(n, k)


def _int4_layout_half_block(packed: torch.Tensor, codes: torch.Tensor) -> int:
    """The CPU int4 packing's half block (rows per nibble half: 32 with AVX-512, 16 with AVX2)
    when ``packed`` decodes back to ``codes`` that way, else 0 (keep plain nibbles)."""
    n, k = codes.shape
    for half in (32, 16):
        if n % (2 * half) or packed.numel() != n * k // 2:
            continue
        blocks = packed.view(n // (2 * half), k, half)
        decoded = torch.stack((blocks & 15, blocks >> 4), dim=2)  # [N / 2h, K, 2, h]
        if torch.equal(decoded.permute(0, 2, 3, 1).reshape(n, k), codes):
            return half
    return 0


class Int8Linear(nn.Module):
    """``x @ W.T (+ bias)`` with W held as int8 codes and one scale per output row."""

    codes: torch.Tensor
    scale_bits: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = (int(size) for size in codes.shape)
        self.register_buffer("codes", codes)
        self.register_buffer("scale_bits", _bits(scales))
        self.register_buffer("bias", bias)

    def input_dtype(self) -> torch.dtype:
        """The dtype this layer multiplies in: torch's kernel's bfloat16."""
        return COMPUTE_DTYPE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        out = torch._weight_int8pack_mm(flat, self.codes, self.scale_bits.view(COMPUTE_DTYPE))
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class Int8Embedding(nn.Module):
    """Rows of int8 codes times their scale, in ``dtype``. The codes are held in the int8
    kernel's layout where it computes here (``blocked``), so that a tied lm_head shares them."""

    codes: torch.Tensor
    scale_bits: torch.Tensor

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.embedding_dim = int(codes.shape[1])
        self.blocked = supported(*(int(size) for size in codes.shape))
        self.register_buffer("codes", to_kernel_layout(codes) if self.blocked else codes)
        self.register_buffer("scale_bits", _bits(scales))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.flatten()
        if self.blocked:
            rows = block_rows(self.codes, flat).to(self.dtype)
        else:
            rows = self.codes.index_select(0, flat).to(self.dtype)
        scales = self.scale_bits.view(COMPUTE_DTYPE).index_select(0, flat)
        rows = rows * scales.to(self.dtype).unsqueeze(1)
        return rows.view(*ids.shape, self.embedding_dim)

    def as_linear(self) -> Int8Linear | Int8BlockLinear:
        """The tied lm_head: the same codes and scales (no copy)."""
        if self.blocked:
            return Int8BlockLinear(self.codes, self.scale_bits)
        return Int8Linear(self.codes, self.scale_bits.view(COMPUTE_DTYPE))


def int4_linear(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias: torch.Tensor | None
) -> Int4Linear | Int4BlockLinear:
    """From 4-bit ``codes`` [N, K] (0..15) and per-group ``scale``/``offset`` [N, K / 32] of
    ``w = scale * q + offset``: in our kernel's layout where it computes here, else torch's."""
    if not int4_supported(*(int(size) for size in codes.shape)):
        raise ValueError(f"int4 needs rows % 16 == 0 and columns % 32 == 0: {codes.shape}")
    if int4_available():
        return Int4BlockLinear(codes, scale, offset, _float_bias(bias))
    zero = offset + 8 * scale  # tinygemm's zero is the value of code 8
    scale_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(COMPUTE_DTYPE).contiguous()
    return Int4Linear(codes, scale_zeros, _float_bias(bias))


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 codes and float32 scales of a float weight [N, K]. The scales
    are bfloat16 values (the kernel stores them so) and the codes are computed against them:
    against the float32 scale, the bfloat16 rounding doubled the weights' worst error."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0).bfloat16().float()
    codes = torch.round(weight / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return codes, scales


def int8_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None
) -> Int8Linear | Int8BlockLinear:
    """Per-row int8 in our kernel's layout where it computes here, else torch's."""
    codes, scales = int8_rows(weight)
    if supported(*(int(size) for size in codes.shape)):
        return Int8BlockLinear(to_kernel_layout(codes), _bits(scales), _float_bias(bias))
    return Int8Linear(codes, scales, _float_bias(bias))


def _float_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float().contiguous()


def _bits(values: torch.Tensor) -> torch.Tensor:
    """bfloat16 values as their int16 bit patterns (see the module docstring)."""
    return values.to(COMPUTE_DTYPE).contiguous().view(torch.int16)


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once."""
    seen: dict[int, int] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())
