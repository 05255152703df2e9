"""Model shapes and inputs shared by the GPU benchmarks (random weights, no files)."""

from __future__ import annotations

import os
from typing import Any

import torch

from data_plane.engine.executor import BatchItem
from data_plane.engine.request import Request
from data_plane.engine.sampling import SamplingParams
from data_plane.models.config import ModelConfig
from data_plane.models.llama import LlamaModel

LLAMA3_8B: dict[str, Any] = {
    "architecture": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_layers": 32,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
TINY: dict[str, Any] = {  # the same code paths on a CPU in seconds (smoke runs)
    "architecture": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
}


def build_model(shape: dict[str, Any], device: str) -> tuple[LlamaModel, ModelConfig]:
    """A random bf16 model built on ``device`` (no fp32 copy): linear and embedding weights
    N(0, 0.02), norms 1. On a CPU, Triton's kernels will run in its interpreter."""
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are first jitted
    config = ModelConfig(**shape, dtype=torch.bfloat16)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaModel(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0, 0.02)
    return model.eval(), config


def decode_items(
    batch: int, context: int, block_size: int, first_block: int = 0
) -> list[BatchItem]:
    """``batch`` sequences with ``context`` cached tokens, each decoding one more; sequence
    ``i`` owns consecutive blocks from ``first_block + i * blocks_per_seq``."""
    blocks_per_seq = -(-(context + 1) // block_size)
    items = []
    for index in range(batch):
        request = Request(f"r{index}", [1] * context, SamplingParams(temperature=0), 0.0, index)
        request.output_token_ids = [5]
        request.num_computed_tokens = context
        start = first_block + index * blocks_per_seq
        items.append(BatchItem(request, 1, list(range(start, start + blocks_per_seq))))
    return items
