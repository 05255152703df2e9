"""Load a GGUF checkpoint (llama.cpp's format) of a Llama-family model: the config from its
metadata, each weight dequantized with the ``gguf`` package and copied straight into its place
(q/k/v and gate/up land in their slices of our fused weights), one tensor at a time.

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` for the llama architecture
(so that its RoPE rotates adjacent pairs); that is undone here. Qwen2 files are not permuted.

With ``quantize`` (the CPU default), layers whose weights are quantized in the file stay
quantized in memory (``gguf_quant``); otherwise every weight is dequantized to ``dtype``.

Default dtype (``dtype=None``): the file's own float type when most of its weight elements are
F16 or BF16; float32 otherwise (F32 and quantized files: dequantized values are exact in fp32),
except on CUDA, where float32 serves as bfloat16 (``serving_dtype``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from data_plane.models.config import ModelConfig, ModelConfigError, serving_dtype
from data_plane.models.gguf_quant import is_quantized, quantize_model
from data_plane.models.llama import LlamaModel, empty_model
from data_plane.models.loaded import LoadedModel
from shared.gguf_tokenizer import bundle_from_reader, eos_token_ids, metadata, open_gguf
from shared.tokenizer import TokenizerNotFoundError

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

# GGUF general.architecture values we serve; "llama" also holds Mistral models
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
SUPPORTED_TENSOR_TYPES = (
    *("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
)
# GGUF per-layer tensor -> (our parameter in DecoderLayer, part of a fused weight or None)
LAYER_TENSORS = {
    "attn_norm.weight": ("input_layernorm.weight", None),
    "ffn_norm.weight": ("post_attention_layernorm.weight", None),
    "attn_output.weight": ("o_proj.weight", None),
    "ffn_down.weight": ("down_proj.weight", None),
    "attn_q.weight": ("qkv_proj.weight", "q"),
    "attn_k.weight": ("qkv_proj.weight", "k"),
    "attn_v.weight": ("qkv_proj.weight", "v"),
    "attn_q.bias": ("qkv_proj.bias", "q"),
    "attn_k.bias": ("qkv_proj.bias", "k"),
    "attn_v.bias": ("qkv_proj.bias", "v"),
    "ffn_gate.weight": ("gate_up_proj.weight", "gate"),
    "ffn_up.weight": ("gate_up_proj.weight", "up"),
}
TOP_TENSORS = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


def load_gguf(
    path: Path, dtype: torch.dtype | None, device: str, quantize: bool = False
) -> LoadedModel:
    """A ``.gguf`` file as a model with its tokenizer (from the same file's metadata)."""
    try:
        reader = open_gguf(path)
    except TokenizerNotFoundError as exc:
        raise ModelConfigError(str(exc)) from exc
    permute_qk = _file_architecture(reader) == "llama"
    _check_tensor_types(reader)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = gguf_config(reader, tensors, dtype or serving_dtype(_default_dtype(reader), device))
    try:
        bundle = bundle_from_reader(reader, path.stem)
    except TokenizerNotFoundError as exc:
        raise ModelConfigError(str(exc)) from exc
    model = empty_model(config, device)
    _fill_weights(model, config, reader, permute_qk, quantize)
    tokenizer = bundle.tokenizer if bundle is not None else None
    return LoadedModel(config, model, tokenizer, path.stem)


def _file_architecture(reader: GGUFReader) -> str:
    arch = metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"GGUF general.architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return str(arch)


def _check_tensor_types(reader: GGUFReader) -> None:
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise ModelConfigError(
                f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not "
                f"supported (supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
            )


def _default_dtype(reader: GGUFReader) -> torch.dtype:
    """F16 or BF16 when that type holds most weight elements, else float32."""
    elements: dict[str, int] = {}
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        elements[name] = elements.get(name, 0) + int(tensor.n_elements)
    total = sum(elements.values())
    for name, dtype in (("F16", torch.float16), ("BF16", torch.bfloat16)):
        if elements.get(name, 0) * 2 > total:
            return dtype
    return torch.float32


def gguf_config(
    reader: GGUFReader, tensors: dict[str, ReaderTensor], dtype: torch.dtype
) -> ModelConfig:
    """The ModelConfig the metadata describes; errors name the missing key."""
    arch = _file_architecture(reader)

    def need(key: str) -> int:
        value = metadata(reader, f"{arch}.{key}")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelConfigError(f"GGUF metadata '{arch}.{key}' is missing or not an integer")
        return value

    hidden, num_heads = need("embedding_length"), need("attention.head_count")
    head_dim = metadata(reader, f"{arch}.attention.key_length") or metadata(
        reader, f"{arch}.rope.dimension_count", hidden // max(num_heads, 1)
    )
    name = str(metadata(reader, "general.name", "")).lower()
    family = "mistral" if arch == "llama" and "mistral" in name else arch
    embedding = tensors.get("token_embd.weight")
    vocab = metadata(reader, f"{arch}.vocab_size") or (
        int(embedding.shape[-1]) if embedding is not None else 0
    )
    return ModelConfig(
        architecture=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_layers=need("block_count"),
        num_heads=num_heads,
        num_kv_heads=int(metadata(reader, f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=int(head_dim),
        max_position_embeddings=need("context_length"),
        rms_norm_eps=float(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, tensors),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_token_ids(reader),
        dtype=dtype,
    )


def _rope_scaling(
    reader: GGUFReader, arch: str, tensors: dict[str, ReaderTensor]
) -> dict[str, Any] | None:
    """Linear scaling from metadata, or Llama-3 scaling from a ``rope_freqs`` tensor."""
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none")
    factor = float(metadata(reader, f"{arch}.rope.scaling.factor", 1.0))
    if "rope_freqs.weight" in tensors:
        original = metadata(reader, f"{arch}.rope.scaling.original_context_length")
        return _llama3_scaling(reader, arch, tensors["rope_freqs.weight"], original)
    if kind == "linear" and factor != 1.0:
        return {"rope_type": "linear", "factor": factor}
    if kind in ("none", "linear"):
        return None
    raise ModelConfigError(
        f"GGUF metadata '{arch}.rope.scaling.type' {kind!r} is not supported (none, linear)"
    )


def _llama3_scaling(
    reader: GGUFReader, arch: str, tensor: ReaderTensor, original: int | None
) -> dict[str, Any]:
    """The Llama-3 rope_scaling that gives llama.cpp's per-frequency divisors (``rope_freqs``,
    written with low/high frequency factors 1 and 4; the original context, when the metadata
    lacks it, solved from a divisor between 1 and the factor); other divisors are an error."""
    divisors = torch.from_numpy(_dequantize(tensor)).double().flatten()
    factor = float(divisors.max())
    dim = 2 * divisors.numel()
    theta = float(metadata(reader, f"{arch}.rope.freq_base", 10000.0))
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    wavelen = 2 * math.pi / inv_freq
    if original is None:
        original = _original_context(divisors, wavelen, factor)
    smooth = (original / wavelen - 1.0) / (4.0 - 1.0)
    expected = torch.where(
        wavelen < original / 4.0,
        torch.ones_like(inv_freq),
        torch.where(wavelen > original, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if not torch.allclose(divisors, expected, rtol=1e-3):
        raise ModelConfigError(
            "GGUF tensor 'rope_freqs.weight' does not match Llama-3 rope scaling "
            f"(low 1, high 4, original context {original}); other schemes are not supported"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }


def _original_context(divisors: torch.Tensor, wavelen: torch.Tensor, factor: float) -> int:
    """Solved from a divisor between 1 and ``factor`` (1/d = (1-s)/factor + s, with
    s = (original/wavelen - 1)/3); Llama 3's 8192 when every divisor is 1 or ``factor``."""
    medium = ((divisors > 1 + 1e-6) & (divisors < factor - 1e-6)).nonzero().flatten()
    if not medium.numel():
        return 8192
    index = int(medium[0])
    smooth = (1 / float(divisors[index]) - 1 / factor) / (1 - 1 / factor)
    return round(float(wavelen[index]) * (1 + 3 * smooth))


def _dequantize(tensor: ReaderTensor) -> np.ndarray:
    """The tensor as float32 in torch's dimension order (GGUF lists dimensions reversed)."""
    from gguf.quants import dequantize

    shape = tuple(int(size) for size in reversed(tensor.shape))
    try:
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except (ValueError, NotImplementedError) as exc:
        raise ModelConfigError(f"GGUF tensor {tensor.name!r} cannot be read: {exc}") from exc
    return values if values.flags.writeable else values.copy()


def _fill_weights(
    model: LlamaModel, cfg: ModelConfig, reader: GGUFReader, permute_qk: bool, quantize: bool
) -> None:
    """Each tensor into its parameter (or slice of one), or into the quantized module that
    replaces its layer; every parameter must be filled."""
    expected = _expected_targets(cfg)
    kept = _quantized_modules(reader, expected) if quantize else {}
    filled: set[tuple[str, str | None]] = set()

    def permute(values: torch.Tensor, part: str | None) -> torch.Tensor:
        if not permute_qk or part not in ("q", "k"):
            return values
        return _undo_rope_permutation(values, cfg.num_heads if part == "q" else cfg.num_kv_heads)

    with torch.no_grad():
        for tensor in reader.tensors:
            if tensor.name == "rope_freqs.weight":
                continue  # read into the config's rope_scaling
            target = _target(tensor.name)
            if target not in expected:
                raise ModelConfigError(f"GGUF tensor {tensor.name!r} is not used by this model")
            filled.add(target)
            param_name, part = target
            if param_name.endswith(".weight") and param_name.removesuffix(".weight") in kept:
                continue  # read by quantize_model below
            values = permute(torch.from_numpy(_dequantize(tensor)), part)
            _copy_into(model.get_parameter(param_name), values, _rows(cfg, part), tensor.name)
        missing = sorted(expected[target] for target in set(expected) - filled)
        if missing:
            raise ModelConfigError(f"GGUF file is missing tensors: {', '.join(missing)}")
        biases = {
            name: model.get_parameter(f"{name}.bias").detach()
            for name in kept
            if f"{name}.bias" in dict(model.named_parameters())
        }
        quantize_model(model, cfg, kept, biases, _dequantize, permute)


def _quantized_modules(
    reader: GGUFReader, expected: dict[tuple[str, str | None], str]
) -> dict[str, dict[str | None, ReaderTensor]]:
    """Modules whose every weight tensor is quantized in the file: name -> {part: tensor}."""
    by_module: dict[str, dict[str | None, ReaderTensor]] = {}
    floats: set[str] = set()
    for tensor in reader.tensors:
        param_name, part = _target(tensor.name)
        if (param_name, part) not in expected or not param_name.endswith(".weight"):
            continue
        module = param_name.removesuffix(".weight")
        if module.endswith("layernorm") or module == "norm":
            continue
        by_module.setdefault(module, {})[part] = tensor
        if not is_quantized(tensor):
            floats.add(module)
    return {name: parts for name, parts in by_module.items() if name not in floats}


def _expected_targets(cfg: ModelConfig) -> dict[tuple[str, str | None], str]:
    """(our parameter, fused part) -> the GGUF tensor name that fills it."""
    expected: dict[tuple[str, str | None], str] = {
        (ours, None): gguf_name for gguf_name, ours in TOP_TENSORS.items()
    }
    if cfg.tie_word_embeddings:
        del expected[("lm_head.weight", None)]
    for index in range(cfg.num_layers):
        for gguf_name, (ours, part) in LAYER_TENSORS.items():
            if ours.endswith(".bias") and not cfg.qkv_bias:
                continue
            expected[(f"layers.{index}.{ours}", part)] = f"blk.{index}.{gguf_name}"
    return expected


def _target(name: str) -> tuple[str, str | None]:
    """(our parameter, fused part) for a GGUF tensor name (the name itself when unknown)."""
    if name in TOP_TENSORS:
        return TOP_TENSORS[name], None
    prefix, _, rest = name.partition(".")
    index, _, suffix = rest.partition(".")
    if prefix == "blk" and index.isdigit() and suffix in LAYER_TENSORS:
        ours, part = LAYER_TENSORS[suffix]
        return f"layers.{index}.{ours}", part
    return name, None


def _rows(cfg: ModelConfig, part: str | None) -> slice:
    """The rows of a fused weight that ``part`` fills (all rows when not fused)."""
    if part is None:
        return slice(None)
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    bounds = {
        "q": (0, q_rows),
        "k": (q_rows, q_rows + kv_rows),
        "v": (q_rows + kv_rows, q_rows + 2 * kv_rows),
        "gate": (0, cfg.intermediate_size),
        "up": (cfg.intermediate_size, 2 * cfg.intermediate_size),
    }
    start, stop = bounds[part]
    return slice(start, stop)


def _undo_rope_permutation(values: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores each head's rows as interleaved (first-half, second-half) pairs; put
    the halves back one after the other (the layout of HF and of our RoPE)."""
    rows = values.shape[0]
    if rows % (2 * num_heads):
        raise ModelConfigError(f"q/k rows ({rows}) do not split into {num_heads} heads")
    halves = values.reshape(num_heads, rows // num_heads // 2, 2, *values.shape[1:])
    return halves.transpose(1, 2).reshape(values.shape)


def _copy_into(param: torch.Tensor, values: torch.Tensor, rows: slice, name: str) -> None:
    destination = param.data[rows]
    if tuple(destination.shape) != tuple(values.shape):
        raise ModelConfigError(
            f"GGUF tensor {name!r} has shape {tuple(values.shape)}, "
            f"the config expects {tuple(destination.shape)}"
        )
    destination.copy_(values)
