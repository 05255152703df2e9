"""Random tiny HF checkpoints (built from config with transformers, no downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama3": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
    ),
    "mistral": dict(sliding_window=24, tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True, use_sliding_window=False),
    # the window on layers 1 and 2 only (from max_window_layers on), as transformers applies it
    "qwen2_swa": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
}


def build_hf_model(family: str, directory: Path, seed: int = 0) -> torch.nn.Module:
    import transformers

    config_cls = {
        "llama3": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen2_swa": transformers.Qwen2Config,
    }[family]
    model_cls = {
        "llama3": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen2_swa": transformers.Qwen2ForCausalLM,
    }[family]
    config = config_cls(**COMMON, **FAMILIES[family])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # larger weights than HF's init, so greedy tokens vary
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    return model


@torch.no_grad()
def hf_greedy(
    model: torch.nn.Module, prompt: list[int], num_new: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens by full recompute each step, and the logits at the prompt's last token."""
    ids = list(prompt)
    first_logits = None
    for _ in range(num_new):
        logits = model(torch.tensor([ids])).logits[0, -1]
        if first_logits is None:
            first_logits = logits.float()
        ids.append(int(logits.argmax()))
    assert first_logits is not None
    return ids[len(prompt) :], first_logits
