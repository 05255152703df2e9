"""What a model loader returns: the config, the model (weights in place) and its tokenizer.
Every loader (``loader`` for HF, llama2.c and tiny-random; ``gguf_loader``) builds one."""

from __future__ import annotations

from dataclasses import dataclass

from data_plane.models.config import ModelConfig
from data_plane.models.llama import LlamaModel
from shared.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer | None
    name: str
