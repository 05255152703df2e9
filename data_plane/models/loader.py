"""Load a model from a local path: an HF checkpoint directory, a llama2.c checkpoint, or the
built-in ``tiny-random``. Nothing is ever fetched from a hub."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError, safe_open

from data_plane.models.config import (
    DTYPES,
    ModelConfig,
    ModelConfigError,
    serving_dtype,
    stored_dtype,
)
from data_plane.models.gguf_loader import load_gguf
from data_plane.models.llama import DecoderLayer, LlamaModel, empty_model
from data_plane.models.loaded import LoadedModel
from shared.gguf_tokenizer import load_gguf_bundle
from shared.tokenizer import ByteTokenizer, HFTokenizer, Llama2cTokenizer, Tokenizer

TINY_RANDOM = "tiny-random"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# checkpoint tensors we never need (RoPE tables that older transformers saved)
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
COPY_CHUNK_BYTES = 16 * 1024 * 1024
QUANTIZATIONS = ("auto", "gguf", "none")

__all__ = ["TINY_RANDOM", "LoadedModel", "load_model", "load_tokenizer"]


def load_model(
    path: str,
    tokenizer_path: str | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    seed: int = 0,
    quantization: str | None = None,
) -> LoadedModel:
    """Load ``path`` (directory, ``*.gguf``, ``*.bin`` llama2.c checkpoint, or ``tiny-random``).

    ``quantization`` (vLLM's flag): ``auto`` (None) keeps a GGUF file's quantized weights
    quantized in memory on the CPU and dequantizes them elsewhere; ``gguf`` insists on it;
    ``none`` dequantizes every weight to ``dtype``."""
    torch_dtype = _parse_dtype(dtype)
    keep_quantized = _keep_quantized(quantization, path, device)
    if path == TINY_RANDOM:
        if tokenizer_path is not None:  # as the gateway refuses it
            raise ModelConfigError("tiny-random has its own byte tokenizer: no --tokenizer")
        loaded = _tiny_random(seed, torch_dtype)
    else:
        location = Path(path)
        if not location.exists():
            raise ModelConfigError(f"model path {path!r} does not exist (no hub downloads)")
        if location.is_dir():
            loaded = _load_hf_dir(location, torch_dtype, device)
        elif location.suffix == ".gguf":
            loaded = load_gguf(location, torch_dtype, device, keep_quantized)
        else:
            loaded = _load_llama2c(location, torch_dtype)
    if tokenizer_path is not None:
        loaded.tokenizer = load_tokenizer(Path(tokenizer_path), loaded.config)
    loaded.model.to(device=device, dtype=loaded.config.dtype)
    loaded.model.eval()
    return loaded


def load_tokenizer(path: Path, config: ModelConfig) -> Tokenizer:
    """``--tokenizer``: an HF tokenizer directory or ``tokenizer.json`` (with the model's BOS
    and EOS), a ``.gguf`` file's tokenizer, or a llama2.c ``tok*.bin`` (as the gateway reads
    it: shared.tokenizer.tokenizer_bundle_at)."""
    if not path.exists():
        raise ModelConfigError(f"tokenizer path {str(path)!r} does not exist")
    if path.suffix == ".gguf":
        return load_gguf_bundle(path, "").tokenizer
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.exists():
            raise ModelConfigError(f"tokenizer directory has no tokenizer.json: {path.parent}")
    if path.suffix == ".json":
        return HFTokenizer(path, config.bos_token_id, config.eos_token_ids)
    return Llama2cTokenizer(path)


def _keep_quantized(quantization: str | None, path: str, device: str) -> bool:
    """Whether a GGUF file's quantized layers stay quantized (see ``load_model``)."""
    mode = quantization or "auto"
    if mode not in QUANTIZATIONS:
        raise ModelConfigError(
            f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}"
        )
    on_cpu = torch.device(device).type == "cpu"
    if mode == "gguf" and not path.endswith(".gguf"):
        raise ModelConfigError(f"quantization 'gguf' needs a .gguf model, not {path!r}")
    if mode == "gguf" and not on_cpu:
        raise ModelConfigError(
            f"quantization 'gguf' is served on the CPU only (device {device!r}): "
            "use 'auto' or 'none' to dequantize"
        )
    return mode != "none" and on_cpu


def _parse_dtype(dtype: str | None) -> torch.dtype | None:
    if dtype is None or dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ModelConfigError(f"dtype {dtype!r} is not one of {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


def _tiny_random(seed: int, dtype: torch.dtype | None) -> LoadedModel:
    config = ModelConfig(
        architecture="llama",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=344,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        dtype=dtype or torch.float32,
    )
    generator = torch.Generator().manual_seed(seed)
    model = LlamaModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                continue
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return LoadedModel(config, model, ByteTokenizer(), TINY_RANDOM)


def _load_hf_dir(directory: Path, dtype: torch.dtype | None, device: str = "cpu") -> LoadedModel:
    """Stream an HF checkpoint into a model built without init (in its final dtype, on
    ``device``): each tensor is copied from its shard, cast on the way, straight into its
    parameter or its rows of a fused one, a chunk at a time."""
    config_path = directory / "config.json"
    if not config_path.exists():
        raise ModelConfigError(f"{directory} is not a model directory: config.json is missing")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{config_path} is not valid JSON: {exc}") from exc
    config = ModelConfig.from_hf(raw, dtype or serving_dtype(stored_dtype(raw), device))
    shards = _shard_keys(directory)
    model = empty_model(config, device)
    _load_hf_state(model, shards, config)
    tokenizer_file = directory / "tokenizer.json"
    tokenizer = (
        HFTokenizer(tokenizer_file, config.bos_token_id, config.eos_token_ids)
        if tokenizer_file.exists()
        else None
    )
    return LoadedModel(config, model, tokenizer, directory.name)


def _shard_keys(directory: Path) -> dict[Path, list[str]]:
    """Each shard's tensor names: from ``model.safetensors.index.json`` when there is one, or
    else from the headers of every ``*.safetensors`` file."""
    index_path = directory / SAFETENSORS_INDEX
    if not index_path.exists():
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelConfigError(f"{directory} has no *.safetensors weight files")
        shards: dict[Path, list[str]] = {}
        for file in files:
            with _open_shard(file, "cpu") as handle:
                shards[file] = list(handle.keys())
        return shards
    try:
        weight_map = json.loads(index_path.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ModelConfigError(f"{index_path} is not a safetensors index: {exc}") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelConfigError(f"{index_path} has no 'weight_map'")
    shards = {}
    for key, name in weight_map.items():
        file = directory / str(name)
        if not file.is_file():
            raise ModelConfigError(f"shard {name!r} named in {index_path.name} does not exist")
        shards.setdefault(file, []).append(key)
    return shards


def _open_shard(file: Path, device: str) -> Any:
    try:
        return safe_open(str(file), framework="pt", device=device)
    except (SafetensorError, OSError) as exc:
        raise ModelConfigError(f"cannot read safetensors file {file}: {exc}") from exc


def _hf_targets(model: LlamaModel, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the parameter, or the rows of a fused parameter, it fills."""
    targets = {
        "model.embed_tokens.weight": model.embed_tokens.weight.detach(),
        "model.norm.weight": model.norm.weight.detach(),
    }
    if not cfg.tie_word_embeddings:
        targets["lm_head.weight"] = model.lm_head.weight.detach()
    for index, module in enumerate(model.layers):
        layer = cast(DecoderLayer, module)
        attn, mlp = f"model.layers.{index}.self_attn.", f"model.layers.{index}.mlp."
        qkv = [f"{attn}{p}_proj" for p in "qkv"]
        targets.update(_rows(qkv, ".weight", layer.qkv_proj.weight, layer.qkv_sizes))
        if cfg.qkv_bias:
            targets.update(_rows(qkv, ".bias", layer.qkv_proj.bias, layer.qkv_sizes))
        gate_up = [f"{mlp}gate_proj", f"{mlp}up_proj"]
        sizes = (cfg.intermediate_size, cfg.intermediate_size)
        targets.update(_rows(gate_up, ".weight", layer.gate_up_proj.weight, sizes))
        targets[attn + "o_proj.weight"] = layer.o_proj.weight.detach()
        targets[mlp + "down_proj.weight"] = layer.down_proj.weight.detach()
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, name)
            targets[f"model.layers.{index}.{name}.weight"] = norm.weight.detach()
    return targets


def _rows(
    names: list[str], suffix: str, fused: torch.Tensor, sizes: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """Views of consecutive row blocks of a fused parameter (q/k/v or gate/up)."""
    views = fused.detach().split(list(sizes), dim=0)
    return {name + suffix: view for name, view in zip(names, views, strict=True)}


def _harmless(key: str, cfg: ModelConfig) -> bool:
    """Checkpoint tensors our model does not need and can safely drop."""
    return key.endswith(HARMLESS_SUFFIXES) or (cfg.tie_word_embeddings and key == "lm_head.weight")


def _plan(
    shards: dict[Path, list[str]], targets: dict[str, torch.Tensor], cfg: ModelConfig
) -> list[tuple[Path, str]]:
    """(shard, name) of each weight to copy; every expected weight exactly once, or an error."""
    seen: dict[str, Path] = {}
    unexpected: list[str] = []
    for file, keys in shards.items():
        for key in keys:
            if key not in targets:
                if not _harmless(key, cfg):
                    unexpected.append(key)
            elif key in seen:
                raise ModelConfigError(
                    f"weight {key!r} is in the checkpoint twice ({seen[key].name}, {file.name})"
                )
            else:
                seen[key] = file
    missing = [key for key in targets if key not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelConfigError(f"weight {missing[0]!r} is missing from the checkpoint{more}")
    if unexpected:
        shown = ", ".join(repr(key) for key in unexpected[:3])
        more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
        raise ModelConfigError(
            f"the checkpoint has weights this {cfg.architecture} model does not use: {shown}{more}"
        )
    return [(file, key) for key, file in seen.items()]


def _load_hf_state(model: LlamaModel, shards: dict[Path, list[str]], cfg: ModelConfig) -> None:
    """Copy each planned checkpoint tensor into its destination, cast on the way."""
    targets = _hf_targets(model, cfg)
    device = str(model.embed_tokens.weight.device)
    with torch.no_grad():
        for file, key in _plan(shards, targets, cfg):
            _copy_weight(file, key, targets[key], device)


def _copy_weight(file: Path, key: str, dest: torch.Tensor, device: str) -> None:
    """Copy one tensor in row chunks of at most COPY_CHUNK_BYTES, reopening the shard for each:
    a shard's mapped pages stay resident while it is open, so only one chunk's are at a time."""
    try:
        with _open_shard(file, device) as handle:
            shape = tuple(handle.get_slice(key).get_shape())
        if shape != tuple(dest.shape):
            raise ModelConfigError(
                f"weight {key!r} has shape {shape}, the config implies {tuple(dest.shape)}"
            )
        step = max(1, COPY_CHUNK_BYTES // (4 * dest[0].numel()))  # sources of up to 4 B/element
        for start in range(0, shape[0], step):
            with _open_shard(file, device) as handle:
                dest[start : start + step].copy_(handle.get_slice(key)[start : start + step])
    except SafetensorError as exc:
        raise ModelConfigError(f"weight {key!r} cannot be read from {file}: {exc}") from exc


def _load_llama2c(path: Path, dtype: torch.dtype | None) -> LoadedModel:
    """llama2.c checkpoint (stories260K/README.md); its tokenizer is ``tok*.bin`` beside it."""
    data = path.read_bytes()
    if len(data) < 28:
        raise ModelConfigError(f"{path} is too short to be a llama2.c checkpoint")
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack_from("<7i", data, 0)
    shared = vocab > 0
    config = ModelConfig(
        architecture="llama",
        vocab_size=abs(vocab),
        hidden_size=dim,
        intermediate_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=dim // n_heads if n_heads > 0 else 1,
        max_position_embeddings=seq_len,
        tie_word_embeddings=shared,
        dtype=dtype or torch.float32,
    )
    model = LlamaModel(config)
    _load_llama2c_weights(
        model, config, torch.frombuffer(bytearray(data[28:]), dtype=torch.float32)
    )
    tokenizer = next(iter(sorted(path.parent.glob("tok*.bin"))), None)
    return LoadedModel(config, model, Llama2cTokenizer(tokenizer) if tokenizer else None, path.stem)


def _load_llama2c_weights(model: LlamaModel, cfg: ModelConfig, flat: torch.Tensor) -> None:
    dim, hid, n_l, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.head_dim
    kv_dim = cfg.num_kv_heads * hd
    offset = 0

    def take(*shape: int) -> torch.Tensor:
        nonlocal offset
        count = 1
        for size in shape:
            count *= size
        if offset + count > flat.numel():
            raise ModelConfigError("llama2.c checkpoint is truncated (header does not match)")
        out = flat[offset : offset + count].view(*shape)
        offset += count
        return out

    emb = take(cfg.vocab_size, dim)
    att_norm, wq, wk = take(n_l, dim), take(n_l, dim, dim), take(n_l, kv_dim, dim)
    wv, wo, ffn_norm = take(n_l, kv_dim, dim), take(n_l, dim, dim), take(n_l, dim)
    w1, w2, w3 = take(n_l, hid, dim), take(n_l, dim, hid), take(n_l, hid, dim)
    final_norm = take(dim)
    take(cfg.max_position_embeddings * hd // 2 * 2)  # legacy RoPE tables
    with torch.no_grad():
        model.embed_tokens.weight.copy_(emb)
        model.norm.weight.copy_(final_norm)
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.copy_(take(cfg.vocab_size, dim))
        for i, module in enumerate(model.layers):
            layer = cast(DecoderLayer, module)
            q = _interleaved_to_half(wq[i], cfg.num_heads)
            k = _interleaved_to_half(wk[i], cfg.num_kv_heads)
            layer.qkv_proj.weight.copy_(torch.cat([q, k, wv[i]]))
            layer.o_proj.weight.copy_(wo[i])
            layer.gate_up_proj.weight.copy_(torch.cat([w1[i], w3[i]]))
            layer.down_proj.weight.copy_(w2[i])
            layer.input_layernorm.weight.copy_(att_norm[i])
            layer.post_attention_layernorm.weight.copy_(ffn_norm[i])


def _interleaved_to_half(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder q/k rows so llama2.c's adjacent-pair RoPE becomes the half-rotation RoPE."""
    rows, cols = weight.shape
    return (
        weight.view(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    )
