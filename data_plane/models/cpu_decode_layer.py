"""One decoder layer of a decode-only batch in one call to the CPU kernels
(``cpu_decode_layer.c``): what ``llama.DecoderLayer`` otherwise runs as ~30 interpreted calls,
which at one stream cost about as much as the layer's arithmetic.

It serves where every piece has its kernel here: the four matmuls int4 in our layout
(``Int4BlockLinear``, AVX512-VNNI), float32 activations and cache, decodes only (one token per
sequence, block tables for attention in place), fewer than ``DENSE_MIN_ROWS`` of them. Anywhere
else :func:`decode_layer` returns None and the layer runs op by op.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from data_plane.models.attention_metadata import AttentionMetadata
from data_plane.models.cpu_kernels import kernels, plain_f32, plain_index
from data_plane.models.int4_blocks import DENSE_MIN_ROWS, Int4BlockLinear

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Int4Weight(ctypes.Structure):
    _fields_ = [("codes", _PTR), ("scales", _PTR), ("bias", _PTR), ("n", _I64), ("k", _I64)]


class DecodeLayerArgs(ctypes.Structure):
    """``struct decode_layer_args`` of cpu_decode_layer.c, field for field."""

    _fields_ = [
        *[(name, _PTR) for name in ("x", "residual", "out")],
        *[(name, _I64) for name in ("first", "m", "hidden", "intermediate")],
        *[(name, _I64) for name in ("num_heads", "num_kv_heads", "head_dim")],
        ("norm1", _PTR),
        ("norm2", _PTR),
        ("eps", _F32),
        ("scale", _F32),
        *[(name, _Int4Weight) for name in ("qkv", "o", "gate_up", "down")],
        *[(name, _PTR) for name in ("cos", "sin", "cache", "slot_rows", "tables", "lens")],
        *[(name, _I64) for name in ("layer_offset", "block_size", "width", "rows_per_block")],
        ("window", _I64),
        ("num_threads", _I64),
    ]


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """A decoder layer's weights and shape, as its module holds them."""

    qkv: Int4BlockLinear
    o: Int4BlockLinear
    gate_up: Int4BlockLinear
    down: Int4BlockLinear
    norms: tuple[torch.Tensor, torch.Tensor]  # input, post-attention RMSNorm weights
    eps: float
    heads: tuple[int, int, int]  # (q heads, kv heads, head_dim)
    window: int | None


def _weight(linear: Int4BlockLinear) -> _Int4Weight:
    bias = None if linear.bias is None else linear.bias.data_ptr()
    return _Int4Weight(
        linear.codes.data_ptr(),
        linear.scale_bits.data_ptr(),
        bias,
        linear.out_features,
        linear.in_features,
    )


class FusedDecodeLayer:
    """A layer's :class:`DecodeLayerArgs` with its weights, norms and shape filled once (they
    cost ~20 us a layer to gather, 0.6 ms a step at 30 layers); each call fills in the step's
    pointers, in a copy (concurrent steps never share one). It keeps ``weights`` alive; its
    owner drops it when they may change."""

    def __init__(self, weights: LayerWeights) -> None:
        self.weights = weights
        num_heads, num_kv_heads, head_dim = weights.heads
        args = DecodeLayerArgs()
        args.hidden = weights.qkv.in_features
        args.intermediate = weights.down.in_features
        args.num_heads, args.num_kv_heads, args.head_dim = num_heads, num_kv_heads, head_dim
        args.norm1, args.norm2 = (norm.data_ptr() for norm in weights.norms)
        args.eps, args.scale = weights.eps, head_dim**-0.5
        args.qkv, args.o = _weight(weights.qkv), _weight(weights.o)
        args.gate_up, args.down = _weight(weights.gate_up), _weight(weights.down)
        args.window = weights.window or 0
        self.args = args
        self.plain = plain_f32(*weights.norms)


def decode_layer(
    layer: FusedDecodeLayer,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache_rows: torch.Tensor,
    layer_offset: int,
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the layer's MLP output, the residual stream) as ``DecoderLayer.forward`` returns them,
    or None (nothing done) where the fused kernel does not serve this batch."""
    found = kernels()
    tables, lens = meta.decode_tables, meta.decode_context_lens
    m = x.shape[0]
    if (
        found is None
        or not layer.plain
        or not found.int4_matmul_available()
        or meta.paged is not None
        or tables is None
        or not 0 < meta.num_decodes == m < DENSE_MIN_ROWS
        or x.shape[1] != layer.args.hidden
        or not plain_f32(x, cache_rows, *rope)
        or (residual is not None and not plain_f32(residual))
        or not plain_index(tables, lens, meta.slot_rows)
    ):
        return None
    stream = x if residual is None else residual  # the first layer's stream is the embedding
    out = torch.empty_like(x)
    args = DecodeLayerArgs.from_buffer_copy(layer.args)
    args.x, args.residual, args.out = x.data_ptr(), stream.data_ptr(), out.data_ptr()
    args.first, args.m = int(residual is None), m
    args.cos, args.sin = rope[0].data_ptr(), rope[1].data_ptr()
    args.cache, args.slot_rows = cache_rows.data_ptr(), meta.slot_rows.data_ptr()
    args.tables, args.lens = tables.data_ptr(), lens.data_ptr()
    args.layer_offset, args.block_size = layer_offset, meta.block_size
    args.width, args.rows_per_block = tables.shape[1], meta.rows_per_block
    args.num_threads = torch.get_num_threads()
    status = found.decode_layer(ctypes.byref(args))
    if status == -2:
        raise MemoryError("decode_layer: no memory for its workspace")
    return (out, stream) if status == 0 else None
