"""One config for every Llama-family decoder we serve (Llama 1/2/3, Mistral, Qwen2)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.errors import ConfigError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class ModelConfigError(ConfigError):
    """A model directory or config that cannot be served; the message names the field."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    full_attention_layers: frozenset[int] = frozenset()  # layers the window does not apply to
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = field(default=(2,))
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"config field {name!r} must be > 0")
        if self.num_heads <= 0 or self.num_kv_heads <= 0:
            raise ModelConfigError(
                "config fields 'num_attention_heads' and 'num_key_value_heads' must be > 0"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"config field 'num_key_value_heads' ({self.num_kv_heads}) must divide "
                f"'num_attention_heads' ({self.num_heads})"
            )

    def window_of(self, layer_index: int) -> int | None:
        """The sliding window of layer ``layer_index`` (None: it attends to the whole context)."""
        return None if layer_index in self.full_attention_layers else self.sliding_window

    @property
    def kv_bytes_per_token(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element

    @classmethod
    def from_hf(cls, raw: dict[str, Any], dtype: torch.dtype | None = None) -> ModelConfig:
        """Validate a Hugging Face ``config.json``; errors name the offending field."""
        architectures = raw.get("architectures")
        if not isinstance(architectures, list) or not architectures:
            raise ModelConfigError("config field 'architectures' is missing or empty")
        arch = architectures[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"config field 'architectures': {arch!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        hidden = _require_int(raw, "hidden_size")
        num_heads = _require_int(raw, "num_attention_heads")
        head_dim = raw.get("head_dim") or hidden // num_heads
        _check_activation(raw)
        theta, scaling = _rope_params(raw)
        num_layers = _require_int(raw, "num_hidden_layers")
        window, full_layers = _sliding_window(raw, family, num_layers)
        return cls(
            architecture=family,
            vocab_size=_require_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_require_int(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            sliding_window=window,
            full_attention_layers=full_layers,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            dtype=dtype or stored_dtype(raw),
        )


def _require_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelConfigError(f"config field {key!r} is missing or not an integer: {value!r}")
    return value


DEFAULT_WINDOW = 4096  # transformers' Mistral/Qwen2 configs' default when the key is absent
QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config default
LAYER_TYPES = ("full_attention", "sliding_attention")


def _check_activation(raw: dict[str, Any]) -> None:
    """The MLP is SwiGLU: ``hidden_act`` must be SiLU (a GELU model would be served wrong)."""
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ModelConfigError(f"config field 'hidden_act': {act!r} is not supported (silu)")


def _sliding_window(
    raw: dict[str, Any], family: str, num_layers: int
) -> tuple[int | None, frozenset[int]]:
    """The window and the layers it skips, as transformers reads them: Llama has none (a
    stray ``sliding_window`` is ignored); Mistral's and Qwen2's default to 4096 when the key
    is absent; Qwen2's needs ``use_sliding_window`` and applies from ``max_window_layers`` on;
    an explicit ``layer_types`` (transformers 5) names each layer's kind."""
    if family == "llama":
        return None, frozenset()
    # transformers' default when the key is absent: 4096 for both (Qwen2's with its flag set)
    window = raw.get("sliding_window", DEFAULT_WINDOW)
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return None, frozenset()
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ModelConfigError(
            f"config field 'sliding_window': {window!r} is not supported (one window, > 0)"
        )
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = int(raw.get("max_window_layers", QWEN2_DEFAULT_MAX_WINDOW_LAYERS))
        layer_types = [LAYER_TYPES[family != "qwen2" or i >= first] for i in range(num_layers)]
    if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ModelConfigError(
            f"config field 'layer_types': {layer_types!r} is not supported "
            f"({num_layers} of {', '.join(LAYER_TYPES)})"
        )
    full = frozenset(i for i, kind in enumerate(layer_types) if kind == "full_attention")
    return (None, frozenset()) if len(full) == num_layers else (window, full)


def _rope_params(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and scaling from either transformers 4 (rope_theta, rope_scaling) or
    transformers 5 (rope_parameters) config keys."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params or None
    nested = (scaling or {}).get("rope_theta") or params.get("rope_theta")
    theta = float(nested or raw.get("rope_theta") or 10000.0)  # transformers 5: nested wins
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            return theta, None
        if rope_type not in ("llama3", "linear"):
            raise ModelConfigError(
                f"config field 'rope_scaling': rope_type {rope_type!r} "
                "is not supported (default, linear, llama3)"
            )
        scaling = {**scaling, "rope_type": rope_type}
    return theta, scaling


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def stored_dtype(raw: dict[str, Any]) -> torch.dtype:
    """The float type an HF ``config.json`` says its weights are stored in (float32 if none)."""
    name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if name not in DTYPES:
        raise ModelConfigError(f"config field 'torch_dtype': unsupported dtype {name!r}")
    return DTYPES[name]


def serving_dtype(stored: torch.dtype, device: str) -> torch.dtype:
    """``--dtype auto`` for HF and GGUF checkpoints: the checkpoint's own float type, except
    that float32 (or a quantized file dequantized) serves in bfloat16 on CUDA, where float32
    would halve the bandwidth. (llama2.c files and ``tiny-random`` keep float32: test models.)"""
    if stored == torch.float32 and torch.device(device).type == "cuda":
        return torch.bfloat16
    return stored


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies, with Llama-3 or linear scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
