"""Llama-family decoders over a block-first paged KV cache, their loaders and tokenizers."""

from __future__ import annotations

from data_plane.models.config import ModelConfig, ModelConfigError
from data_plane.models.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "ModelConfig", "ModelConfigError", "load_model"]
