"""The Llama-family decoder (Llama 1/2/3, Mistral, Qwen2): GQA, RoPE, RMSNorm, SwiGLU."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from data_plane.models.attention import AttentionMetadata, paged_attention, write_kv
from data_plane.models.config import ModelConfig, rope_inv_freq
from data_plane.models.cpu_decode_layer import FusedDecodeLayer, LayerWeights, decode_layer
from data_plane.models.cpu_kernels import rms_norm as cpu_rms_norm
from data_plane.models.cpu_kernels import rope_write_kv as cpu_rope_write_kv
from data_plane.models.dense import DenseLinear
from data_plane.models.int4_blocks import Int4BlockLinear
from data_plane.models.triton_fused import rms_norm as fused_rms_norm
from data_plane.models.triton_fused import rope_write_kv as fused_rope_write_kv
from data_plane.models.triton_fused import silu_and_mul


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_rms_norm(x, None, self.weight, self.eps)  # float32 on the CPU
        if out is not None:
            return out
        if x.dtype == torch.float32:  # the same arithmetic, one fused op
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of ``residual + x``, that sum): the residual stream's add fused into the
        norm on the CPU (the sum may be written into ``residual``)."""
        out = cpu_rms_norm(x, residual, self.weight, self.eps)
        if out is not None:
            return out, residual
        total = residual + x
        return self(total), total


class Rotary(nn.Module):
    """Half-rotation RoPE (HF layout); llama2.c checkpoints are permuted to it at load."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(positions, inv_freq)
        # Plain tensors, not buffers: kept in fp32 whatever dtype the weights are cast to.
        self.cos = freqs.cos().float()
        self.sin = freqs.sin().float()

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, d/2]`` of the step's positions: gathered once per forward and
        shared by every layer."""
        if self.cos.device != positions.device:
            self.cos = self.cos.to(positions.device)
            self.sin = self.sin.to(positions.device)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.sliding_window = config.window_of(layer_index)
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = DenseLinear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = DenseLinear(q_size, config.hidden_size, bias=False)
        self.gate_up_proj = DenseLinear(
            config.hidden_size, 2 * config.intermediate_size, bias=False
        )
        self.down_proj = DenseLinear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # dtype of the MLP's input and intermediate activations; None: the model's. Set to
        # bfloat16 when both MLP matmuls are quantized (their kernels compute in bfloat16), so
        # that SiLU and the product run on what the kernels return, with no casts between.
        self.mlp_dtype: torch.dtype | None = None
        # The fused CPU decode kernel's view of this layer, with the modules it was built from
        self._fused: tuple[tuple[nn.Module, ...], FusedDecodeLayer] | None = None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache_rows: torch.Tensor,
        layer_offset: int,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream it is still to be added to): the next
        layer's norm, or the final one, adds the two (vLLM's convention: the add fuses into the
        norm). ``residual`` None: ``x`` is the embedding, the stream's start."""
        if meta.paged is not None:
            return self._forward_paged(x, residual, rope, cache_rows, layer_offset, meta)
        layer = self._fused_layer()
        if layer is not None:
            fused = decode_layer(layer, x, residual, rope, cache_rows, layer_offset, meta)
            if fused is not None:
                return fused
        n = x.shape[0]
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        q = self._rope_write_kv(self.qkv_proj(h), rope, cache_rows, layer_offset, meta)
        scale = self.head_dim**-0.5
        attn = paged_attention(q, cache_rows, layer_offset, meta, scale, self.sliding_window)
        h, residual = self.post_attention_layernorm.add_forward(
            self.o_proj(attn.reshape(n, -1)), residual
        )
        if self.mlp_dtype is not None:
            h = h.to(self.mlp_dtype)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        # fp16 + bf16 would be fp32: the residual stream keeps the model's dtype
        return self.down_proj(F.silu(gate) * up).to(residual.dtype), residual

    def _forward_paged(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache_rows: torch.Tensor,
        layer_offset: int,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` on the Triton path: nine launches, the element-wise steps fused
        (``triton_fused``)."""
        n, eps = x.shape[0], self.input_layernorm.eps
        h, residual = fused_rms_norm(x, residual, self.input_layernorm.weight, eps)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        offsets = (layer_offset, meta.block_size)
        q = fused_rope_write_kv(self.qkv_proj(h), heads, rope, cache_rows, meta.slot_rows, offsets)
        scale = self.head_dim**-0.5
        attn = paged_attention(q, cache_rows, layer_offset, meta, scale, self.sliding_window)
        h, residual = fused_rms_norm(
            self.o_proj(attn.reshape(n, -1)), residual, self.post_attention_layernorm.weight, eps
        )
        if self.mlp_dtype is not None:
            h = h.to(self.mlp_dtype)
        mlp = self.down_proj(silu_and_mul(self.gate_up_proj(h)))
        return mlp.to(residual.dtype), residual

    def _fused_layer(self) -> FusedDecodeLayer | None:
        """This layer for the fused CPU decode kernel, where all four matmuls are int4 in its
        layout. Built once and kept while the same six modules are in place (loaders swap
        them: checked at each call); :meth:`_apply` (``to``, ``float``, ...) drops it."""
        modules = (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)
        norms = (self.input_layernorm, self.post_attention_layernorm)
        kept = self._fused
        if kept is not None and kept[0] == (*modules, *norms):  # identity: Module eq is `is`
            return kept[1]
        self._fused = None
        if not all(isinstance(linear, Int4BlockLinear) for linear in modules):
            return None
        weights = LayerWeights(
            *modules,  # type: ignore[arg-type]
            norms=(norms[0].weight, norms[1].weight),
            eps=norms[0].eps,
            heads=(self.num_heads, self.num_kv_heads, self.head_dim),
            window=self.sliding_window,
        )
        layer = FusedDecodeLayer(weights)
        self._fused = ((*modules, *norms), layer)
        return layer

    def _apply(self, fn: Any, recurse: bool = True) -> DecoderLayer:
        self._fused = None  # tensors may move or change dtype: gathered again at the next call
        return super()._apply(fn, recurse)

    def _rope_write_kv(
        self,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache_rows: torch.Tensor,
        layer_offset: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """RoPE on the q and k heads of ``qkv``, k and v stored in the cache; the rotated q
        ``[n, heads, head_dim]``. One kernel call on the CPU (float32), torch ops elsewhere."""
        n, heads = qkv.shape[0], (self.num_heads, self.num_kv_heads, self.head_dim)
        if meta.paged is None and cpu_rope_write_kv(
            qkv, heads, rope, cache_rows, meta.slot_rows, (layer_offset, meta.block_size)
        ):
            return qkv[:, : self.qkv_sizes[0]].view(n, self.num_heads, self.head_dim)
        qk_size, v_size = self.qkv_sizes[0] + self.qkv_sizes[1], self.qkv_sizes[2]
        qk, v = qkv.split((qk_size, v_size), dim=-1)
        # q's and k's heads rotated together: one pass over [n, heads + kv_heads, head_dim]
        qk = _rotate(qk.view(n, -1, self.head_dim), *rope)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        write_kv(cache_rows, layer_offset, k, v.view(n, self.num_kv_heads, self.head_dim), meta)
        return q


class LlamaModel(nn.Module):
    """Token ids of a flattened batch in, logits of the selected positions out."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = DenseLinear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """``kv_cache``: (num_blocks, num_layers, 2, block_size, kv_heads, head_dim),
        contiguous (the block-first layout)."""
        x = self.embed_tokens(input_ids)
        cache_rows = kv_cache.view(-1, *kv_cache.shape[-2:])
        rope = self.rotary.tables(positions)
        residual: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            offset = 2 * index * meta.block_size
            x, residual = layer(x, residual, rope, cache_rows, offset, meta)
        if residual is not None:
            x, residual = x[logits_indices], residual[logits_indices]
            if meta.paged is not None:
                x, _ = fused_rms_norm(x, residual, self.norm.weight, self.norm.eps)
            else:
                x, _ = self.norm.add_forward(x, residual)
        else:
            x = self.norm(x[logits_indices])
        return self.lm_head(x).float()


_RANDOM_INIT = (torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.kaiming_uniform_)
_FACTORIES = (torch.empty, torch.ones, torch.zeros)  # what the modules' __init__ allocate with


class _EmptyInit(TorchFunctionMode):
    """Inside: the modules' random init is skipped and their parameters are allocated in
    ``dtype`` (thread-local, unlike ``torch.set_default_dtype``)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _RANDOM_INIT:
            return args[0] if args else kwargs["tensor"]
        if func in _FACTORIES and kwargs.get("dtype") is None:
            kwargs["dtype"] = self.dtype
        return func(*args, **kwargs)


def empty_model(config: ModelConfig, device: str | torch.device = "cpu") -> LlamaModel:
    """The model with uninitialised weights of ``config.dtype`` on ``device``, allocated once
    (no random init, no cast), so that a loader can fill each parameter from its checkpoint
    tensor. Not built on the meta device: torch's meta kernels for ``normal_``, ``arange`` and
    ``empty_like`` are Python refs whose first use imports torch._dynamo and sympy (~200 MiB of
    host memory and ~1 s in a process with no other use for them; bench/load_memory.py)."""
    with torch.device(device), _EmptyInit(config.dtype):
        return LlamaModel(config)
