"""How many KV blocks the HBM pool gets and the longest context it serves, with vLLM's meaning
of the flags: ``--gpu-memory-utilization`` is the fraction of the device's memory the whole
worker may use (weights, the activation peak of a full batch, the CUDA context and the decode
graphs, then the KV pool), and
``--max-model-len`` must fit in the pool (a clear error, never a silent cap).

Precedence: ``num_hbm_blocks`` > ``hbm_kv_gib`` > ``gpu_memory_utilization`` > the device's
default (0.9 of a CUDA device, as vLLM; a fixed ``DEFAULT_CPU_KV_GIB`` on the CPU, where the
"device" is the host that also runs everything else)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import structlog
import torch

from data_plane.engine.config import EngineConfig
from data_plane.engine.cuda_graphs import graph_memory_bytes
from data_plane.engine.executor import BatchItem
from data_plane.engine.model_runner import ModelRunner
from data_plane.engine.request import Request
from data_plane.engine.sampling import SamplingParams
from data_plane.kv.geometry import KVGeometry
from data_plane.models.llama import LlamaModel
from data_plane.models.quant import module_bytes
from shared.errors import ConfigError

log = structlog.get_logger(__name__)

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_CPU_KV_GIB = 1.0
CPU_ACTIVATION_SAFETY = 2.0  # the analytic CPU estimate counts each live tensor once


class KVSizingError(ConfigError):
    """The KV pool cannot be sized as asked; the message names the flag to change."""


@dataclass(frozen=True, slots=True)
class PoolSize:
    num_blocks: int
    max_model_len: int
    how: str  # what decided the size, for the start-up log


def device_total_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def weights_bytes(model: LlamaModel) -> int:
    """Parameters and buffers (a quantized layer's codes and scales), each storage once."""
    return module_bytes(model)


def activation_peak_bytes(runner: ModelRunner, config: EngineConfig, vocab_size: int) -> int:
    """The memory one full batch (``max_num_batched_tokens`` prefill tokens) needs beyond the
    weights: measured with a profile forward on CUDA (it also warms the kernels up), estimated
    from the model's shapes on the CPU."""
    model = runner.model
    num_tokens = config.max_num_batched_tokens
    if runner.device.type != "cuda":
        cfg = model.config
        element = torch.tensor([], dtype=cfg.dtype).element_size()
        q_kv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        per_token = 4 * cfg.hidden_size + q_kv + 3 * cfg.intermediate_size
        logits = min(num_tokens, config.max_num_seqs) * vocab_size * 4
        return int((num_tokens * per_token * element + logits) * CPU_ACTIVATION_SAFETY)
    torch.cuda.synchronize(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    before = torch.cuda.memory_allocated(runner.device)
    profile_forward(runner, config.block_size, num_tokens, vocab_size)
    torch.cuda.synchronize(runner.device)
    return int(torch.cuda.max_memory_allocated(runner.device) - before)


def outside_torch_bytes(device: torch.device) -> int:
    """Device memory in use that torch's allocator does not hold (the CUDA context, library
    workspaces); 0 off CUDA. Another process on the same GPU counts too: the pool is sized as
    if this worker had the device to itself apart from what is already in use."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(total - free) - int(torch.cuda.memory_reserved(device)))


def graphs_bytes(runner: ModelRunner) -> int:
    """What the runner's decode graphs will hold once captured (0 without graphs)."""
    if runner.graphs is None:
        return 0
    return graph_memory_bytes(runner.model.config, runner.graphs.sizes[-1])


def profile_forward(runner: ModelRunner, block_size: int, num_tokens: int, vocab: int) -> None:
    """One prefill of ``num_tokens`` tokens into a scratch KV tensor (freed on return)."""
    cfg = runner.model.config
    geometry = KVGeometry(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
    num_blocks = math.ceil(num_tokens / block_size)
    scratch = geometry.allocate(num_blocks, runner.device)
    prompt = [i % vocab for i in range(num_tokens)]
    request = Request("profile", prompt, SamplingParams(max_tokens=1), 0.0, 0)
    runner.execute([BatchItem(request, num_tokens, list(range(num_blocks)))], scratch)
    del scratch


def size_hbm_pool(
    config: EngineConfig, geometry: KVGeometry, runner: ModelRunner, vocab_size: int
) -> tuple[int, str]:
    """The HBM pool's block count and what decided it."""
    if config.num_hbm_blocks is not None:
        return config.num_hbm_blocks, f"num_hbm_blocks={config.num_hbm_blocks}"
    if config.hbm_kv_gib is not None:
        return geometry.blocks_in(config.hbm_kv_gib), f"hbm_kv_gib={config.hbm_kv_gib}"
    utilization = config.gpu_memory_utilization
    if utilization is None and runner.device.type != "cuda":
        gib = DEFAULT_CPU_KV_GIB
        return geometry.blocks_in(gib), f"default on the CPU: {gib} GiB"
    utilization = utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    total = device_total_bytes(runner.device)
    used = weights_bytes(runner.model) + activation_peak_bytes(runner, config, vocab_size)
    used += outside_torch_bytes(runner.device) + graphs_bytes(runner)
    free = int(total * utilization) - used
    if free < geometry.block_bytes:
        raise KVSizingError(
            f"gpu_memory_utilization={utilization} of {total / 2**30:.1f} GiB leaves no room "
            f"for KV after the weights and a full batch's activations "
            f"({used / 2**30:.2f} GiB); raise --gpu-memory-utilization or lower "
            "--max-num-batched-tokens"
        )
    how = (
        f"gpu_memory_utilization={utilization}: {total / 2**30:.1f} GiB x {utilization} - "
        f"{used / 2**30:.2f} GiB weights, activations, CUDA graphs and context"
    )
    return free // geometry.block_bytes, how


def validate_max_model_len(
    requested: int | None, model_max: int, num_blocks: int, block_size: int
) -> int:
    """The context length served. A ``--max-model-len`` beyond the model or the pool is an
    error; without one, the model's own length is capped at the pool with a warning."""
    capacity = num_blocks * block_size
    if requested is not None:
        if requested < 1:
            raise KVSizingError(f"--max-model-len must be >= 1, got {requested}")
        if requested > model_max:
            raise KVSizingError(
                f"--max-model-len {requested} is longer than the model's context "
                f"({model_max} tokens, max_position_embeddings)"
            )
        if requested > capacity:
            raise KVSizingError(
                f"--max-model-len {requested} does not fit in the KV pool ({num_blocks} blocks "
                f"x {block_size} = {capacity} tokens); raise --gpu-memory-utilization or "
                "--hbm-kv-gib, or lower --max-model-len"
            )
        return requested
    if model_max > capacity:
        log.warning(
            "max_model_len_capped_by_kv_pool",
            model_max_model_len=model_max,
            max_model_len=capacity,
            hint="raise --gpu-memory-utilization or --hbm-kv-gib, or set --max-model-len",
        )
        return capacity
    return model_max
