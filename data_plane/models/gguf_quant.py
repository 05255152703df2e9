"""A GGUF file's quantized weights kept quantized (``quant``'s CPU layers) instead of being
dequantized to floats.

Per layer (or the embedding / lm_head) whose GGUF weights are all of quantized types:
- every part Q4_0, Q4_1 or Q4_K (and the shape allows it): 4-bit (``quant.int4_linear``:
  ``Int4BlockLinear`` where our CPU kernel computes, else ``Int4Linear``) with the file's own
  4-bit codes and per-32 scales/offsets, exact up to the scales' rounding to bfloat16;
- otherwise (Q8_0, Q5_*, Q2/3/5/6_K, or a mix): int8 re-quantized per output row from the
  dequantized values (``quant.int8_linear``: ``Int8BlockLinear`` where our CPU kernel computes,
  else ``Int8Linear``);
- the token embedding: ``Int8Embedding`` (per row), shared by a tied lm_head.

A layer whose two MLP matmuls both compute in bfloat16 (torch's kernels; ours for int4 takes
float32) runs its MLP activations in bfloat16 (``DecoderLayer.mlp_dtype``), with no casts between.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from data_plane.models.config import ModelConfig, ModelConfigError
from data_plane.models.int4_blocks import Int4BlockLinear
from data_plane.models.int8_blocks import Int8BlockLinear
from data_plane.models.llama import LlamaModel
from data_plane.models.quant import (
    COMPUTE_DTYPE,
    INT4_GROUP,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    int4_linear,
    int4_supported,
    int8_linear,
    int8_rows,
)

if TYPE_CHECKING:
    from gguf import ReaderTensor

FLOAT_TYPES = ("F32", "F16", "BF16")
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# our module -> its parameter names (fused parts in the order their rows are stacked)
LINEAR_PARTS = {
    "qkv_proj": ("q", "k", "v"),
    "gate_up_proj": ("gate", "up"),
    "o_proj": (None,),
    "down_proj": (None,),
    "lm_head": (None,),
}

QUANTIZED_LINEARS = (Int4Linear, Int4BlockLinear, Int8Linear, Int8BlockLinear)
Dequantize = Callable[["ReaderTensor"], np.ndarray]
Permute = Callable[[torch.Tensor, str | None], torch.Tensor]


@dataclass(slots=True)
class Int4Groups:
    """``w = scale * code + offset`` for groups of 32 along the input."""

    codes: torch.Tensor  # [N, K] uint8, 0..15
    scale: torch.Tensor  # [N, K / 32] float32
    offset: torch.Tensor  # [N, K / 32] float32


def is_quantized(tensor: ReaderTensor) -> bool:
    return tensor.tensor_type.name not in FLOAT_TYPES


def quantize_model(
    model: LlamaModel,
    cfg: ModelConfig,
    parts: dict[str, dict[str | None, ReaderTensor]],
    biases: dict[str, torch.Tensor],
    dequantize: Dequantize,
    permute: Permute,
) -> None:
    """Swap each module named in ``parts`` (``layers.3.qkv_proj``, ``embed_tokens``,
    ``lm_head``: its GGUF tensors by fused part) for its quantized form."""
    embedding = parts.pop("embed_tokens", None)
    if embedding is not None:
        codes, scales = int8_rows(torch.from_numpy(dequantize(embedding[None])))
        embed = Int8Embedding(codes, scales, cfg.dtype)
        model.embed_tokens = embed  # type: ignore[assignment]
        if cfg.tie_word_embeddings:
            model.lm_head = embed.as_linear()  # type: ignore[assignment]
    for module_name, by_part in parts.items():
        _quantize_linear(model, module_name, by_part, biases.get(module_name), dequantize, permute)
    for layer in model.layers:
        layer.mlp_dtype = _mlp_dtype(layer.gate_up_proj, layer.down_proj)  # type: ignore[assignment]


def _mlp_dtype(*mlp: object) -> torch.dtype | None:
    """bfloat16 where every MLP matmul computes in it, else None (the model's dtype)."""
    dtypes = set()
    for module in mlp:
        if not isinstance(module, QUANTIZED_LINEARS):
            return None
        dtypes.add(module.input_dtype())
    return COMPUTE_DTYPE if dtypes == {COMPUTE_DTYPE} else None


def _quantize_linear(
    model: LlamaModel,
    module_name: str,
    by_part: dict[str | None, ReaderTensor],
    bias: torch.Tensor | None,
    dequantize: Dequantize,
    permute: Permute,
) -> None:
    """One linear module's GGUF tensors as 4-bit where they allow it, else int8."""
    names = LINEAR_PARTS[module_name.rpartition(".")[2]]
    tensors = [by_part[part] for part in names]
    if all(t.tensor_type.name in INT4_TYPES for t in tensors):
        groups = [_int4_part(t, permute, p) for t, p in zip(tensors, names, strict=True)]
        codes = torch.cat([g.codes for g in groups])
        if int4_supported(*codes.shape):
            scale = torch.cat([g.scale for g in groups])
            offset = torch.cat([g.offset for g in groups])
            _swap(model, module_name, int4_linear(codes, scale, offset, bias))
            return
    weights = [
        permute(torch.from_numpy(dequantize(t)), p) for t, p in zip(tensors, names, strict=True)
    ]
    _swap(model, module_name, int8_linear(torch.cat(weights), bias))


def _int4_part(tensor: ReaderTensor, permute: Permute, part: str | None) -> Int4Groups:
    """A Q4 tensor's codes and group scales/offsets read from its blocks (no dequantizing),
    their rows permuted as the weight's."""
    rows, cols = (int(size) for size in reversed(tensor.shape))
    kind = tensor.tensor_type.name
    raw = np.asarray(tensor.data).view(np.uint8)
    if kind == "Q4_K":  # per 256: d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of codes
        blocks = raw.reshape(-1, 144)
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _q4k_scale_min(blocks[:, 4:16])
        scale, offset = d[:, None] * sc, -(dmin[:, None] * mn)
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # chunk j: low nibbles, then high nibbles
    else:  # per 32: d (and m for Q4_1), then 16 bytes: low nibbles, then high nibbles
        blocks = raw.reshape(-1, 18 if kind == "Q4_0" else 20)
        scale = _f16(blocks, 0)
        offset = -8 * scale if kind == "Q4_0" else _f16(blocks, 2)
        qs = blocks[:, -16:].reshape(-1, 1, 1, 16)
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=2).reshape(rows, cols)
    if scale.size != rows * cols // INT4_GROUP:
        raise ModelConfigError(f"GGUF tensor {tensor.name!r}: unexpected {kind} block count")
    groups = (rows, cols // INT4_GROUP)
    return Int4Groups(
        permute(torch.from_numpy(codes), part),
        permute(torch.from_numpy(scale.astype(np.float32).reshape(groups)), part),
        permute(torch.from_numpy(offset.astype(np.float32).reshape(groups)), part),
    )


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32).flatten()


def _q4k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's eight 6-bit sub-block scales and mins per block, as float32."""
    from gguf.quants import Q4_K

    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(packed))
    return sc.astype(np.float32), mn.astype(np.float32)


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
