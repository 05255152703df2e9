"""Reading a Hugging Face ``config.json`` as transformers reads it: which layers slide (Qwen2's
``max_window_layers``, ``layer_types``, Mistral's default window, Llama's none), the RoPE base
when both forms are given, and a clear error for what the model code does not compute."""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from data_plane.models.config import ModelConfig, ModelConfigError

COMMON: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
)


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def _raw(config: transformers.PretrainedConfig) -> dict[str, Any]:
    """``config.json`` as save_pretrained writes it (with the model class it names)."""
    return {**config.to_dict(), "architectures": [ARCHITECTURES[config.model_type]]}


def _ours(config: transformers.PretrainedConfig, drop: tuple[str, ...] = ()) -> ModelConfig:
    raw = _raw(config)
    for key in drop:
        raw.pop(key, None)
    return ModelConfig.from_hf(raw)


def _their_windows(config: transformers.PretrainedConfig) -> list[int | None]:
    """Each layer's window as transformers' attention applies it."""
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * (
        config.num_hidden_layers
    )
    return [config.sliding_window if k == "sliding_attention" else None for k in kinds]


@pytest.mark.parametrize(
    ("use", "max_window_layers", "num_layers"),
    [(True, 1, 3), (True, 28, 4), (True, 0, 3), (False, 1, 3), (True, 2, 5)],
)
def test_qwen2_windows_are_transformers(use: bool, max_window_layers: int, num_layers: int) -> None:
    theirs = transformers.Qwen2Config(
        **COMMON,
        num_hidden_layers=num_layers,
        use_sliding_window=use,
        sliding_window=16,
        max_window_layers=max_window_layers,
    )
    expected = _their_windows(theirs) if theirs.sliding_window else [None] * num_layers
    for drop in ((), ("layer_types",)):  # transformers 5's layer_types, or 4's fields alone
        ours = _ours(theirs, drop)
        assert [ours.window_of(i) for i in range(num_layers)] == expected, drop


def test_qwen2_without_a_window_key_takes_transformers_default() -> None:
    theirs = transformers.Qwen2Config(
        **COMMON, num_hidden_layers=4, use_sliding_window=True, max_window_layers=1
    )
    ours = _ours(theirs, drop=("sliding_window", "layer_types"))
    assert [ours.window_of(i) for i in range(4)] == _their_windows(theirs) == [None] + [4096] * 3


def test_mistral_layer_types_and_default_window() -> None:
    kinds = ["full_attention", "sliding_attention", "full_attention"]
    mixed = transformers.MistralConfig(
        **COMMON, num_hidden_layers=3, sliding_window=16, layer_types=kinds
    )
    ours = _ours(mixed)
    assert [ours.window_of(i) for i in range(3)] == _their_windows(mixed) == [None, 16, None]
    default = transformers.MistralConfig(**COMMON, num_hidden_layers=2)
    ours = _ours(default, drop=("sliding_window", "layer_types"))  # an old config, no key
    assert [ours.window_of(i) for i in range(2)] == [default.sliding_window] * 2 == [4096] * 2
    unset = transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=None)
    no_window = _ours(unset)
    assert no_window.window_of(0) is None


def test_llama_ignores_a_stray_sliding_window() -> None:
    """transformers' Llama attends to the whole context whatever ``sliding_window`` says."""
    raw = _raw(transformers.LlamaConfig(**COMMON, num_hidden_layers=2))
    assert ModelConfig.from_hf({**raw, "sliding_window": 16}).window_of(0) is None


def test_nested_rope_theta_wins() -> None:
    """transformers 5 reads the base from ``rope_parameters`` (``rope_scaling``) when both
    forms are given."""
    raw = _raw(transformers.LlamaConfig(**COMMON, num_hidden_layers=2))
    nested = {"rope_type": "default", "rope_theta": 1e4}
    mixed = {**raw, "rope_theta": 500000.0, "rope_scaling": nested}
    mixed.pop("rope_parameters", None)
    assert ModelConfig.from_hf(mixed).rope_theta == 1e4
    top_level_only = {**raw, "rope_theta": 5e5, "rope_parameters": None}
    assert ModelConfig.from_hf(top_level_only).rope_theta == 5e5


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"sliding_window": [16, None]}, "sliding_window"),
        ({"sliding_window": 16, "layer_types": ["chunked_attention"] * 2}, "layer_types"),
        ({"sliding_window": 16, "layer_types": ["full_attention"]}, "layer_types"),
    ],
)
def test_what_the_model_does_not_compute_is_refused(change: dict[str, Any], field: str) -> None:
    raw = _raw(transformers.MistralConfig(**COMMON, num_hidden_layers=2))
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_hf({**raw, **change})
