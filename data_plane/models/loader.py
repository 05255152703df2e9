"""Load a model from a local path: an HF checkpoint directory, a llama2.c checkpoint, or the
built-in ``tiny-random``. Nothing is ever fetched from a hub."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from data_plane.models.config import DTYPES, ModelConfig, ModelConfigError
from data_plane.models.llama import DecoderLayer, LlamaModel
from shared.tokenizer import ByteTokenizer, HFTokenizer, Llama2cTokenizer, Tokenizer

TINY_RANDOM = "tiny-random"


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer | None
    name: str


def load_model(
    path: str,
    tokenizer_path: str | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> LoadedModel:
    """Load ``path`` (directory, ``*.bin`` llama2.c checkpoint, or ``tiny-random``)."""
    torch_dtype = _parse_dtype(dtype)
    if path == TINY_RANDOM:
        loaded = _tiny_random(seed, torch_dtype)
    else:
        location = Path(path)
        if not location.exists():
            raise ModelConfigError(f"model path {path!r} does not exist (no hub downloads)")
        if location.is_dir():
            loaded = _load_hf_dir(location, torch_dtype)
        else:
            loaded = _load_llama2c(location, torch_dtype)
    if tokenizer_path is not None:
        loaded.tokenizer = load_tokenizer(Path(tokenizer_path), loaded.config)
    loaded.model.to(device=device, dtype=loaded.config.dtype)
    loaded.model.eval()
    return loaded


def load_tokenizer(path: Path, config: ModelConfig) -> Tokenizer:
    if not path.exists():
        raise ModelConfigError(f"tokenizer path {str(path)!r} does not exist")
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.exists():
            raise ModelConfigError(f"tokenizer directory has no tokenizer.json: {path.parent}")
    if path.suffix == ".json":
        return HFTokenizer(path, config.bos_token_id, config.eos_token_ids)
    return Llama2cTokenizer(path)


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


def _load_hf_dir(directory: Path, dtype: torch.dtype | None) -> LoadedModel:
    config_path = directory / "config.json"
    if not config_path.exists():
        raise ModelConfigError(f"{directory} is not a model directory: config.json is missing")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{config_path} is not valid JSON: {exc}") from exc
    config = ModelConfig.from_hf(raw, dtype)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{directory} has no *.safetensors weight files")
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    model = LlamaModel(config)
    _load_hf_state(model, state, config)
    tokenizer_file = directory / "tokenizer.json"
    tokenizer = (
        HFTokenizer(tokenizer_file, config.bos_token_id, config.eos_token_ids)
        if tokenizer_file.exists()
        else None
    )
    return LoadedModel(config, model, tokenizer, directory.name)


def _take(state: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state:
        raise ModelConfigError(f"weight {key!r} is missing from the checkpoint")
    return state.pop(key)


def _load_hf_state(model: LlamaModel, state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    with torch.no_grad():
        model.embed_tokens.weight.copy_(_take(state, "model.embed_tokens.weight"))
        model.norm.weight.copy_(_take(state, "model.norm.weight"))
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.copy_(_take(state, "lm_head.weight"))
        for index, module in enumerate(model.layers):
            layer = cast(DecoderLayer, module)
            prefix = f"model.layers.{index}."
            attn = prefix + "self_attn."
            qkv = [_take(state, f"{attn}{p}_proj.weight") for p in "qkv"]
            layer.qkv_proj.weight.copy_(torch.cat(qkv))
            if cfg.qkv_bias:
                layer.qkv_proj.bias.copy_(
                    torch.cat([_take(state, f"{attn}{p}_proj.bias") for p in "qkv"])
                )
            layer.o_proj.weight.copy_(_take(state, attn + "o_proj.weight"))
            mlp = prefix + "mlp."
            gate_up = [_take(state, f"{mlp}{p}_proj.weight") for p in ("gate", "up")]
            layer.gate_up_proj.weight.copy_(torch.cat(gate_up))
            layer.down_proj.weight.copy_(_take(state, mlp + "down_proj.weight"))
            layer.input_layernorm.weight.copy_(_take(state, prefix + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(
                _take(state, prefix + "post_attention_layernorm.weight")
            )


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
