"""Offline generation: build an engine for a model and run prompts to completion."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from data_plane.engine.config import EngineConfig
from data_plane.engine.cuda_graphs import GRAPH_MEMORY_FRACTION, graph_batch_limit
from data_plane.engine.engine import Engine, Planner
from data_plane.engine.executor import ModelExecutor
from data_plane.engine.model_runner import ModelRunner
from data_plane.engine.request import FinishReason, RequestError
from data_plane.engine.sampling import SamplingParams
from data_plane.engine.sizing import device_total_bytes, size_hbm_pool, validate_max_model_len
from data_plane.engine.structured import Grammars
from data_plane.kv.geometry import KVGeometry
from data_plane.kv.host_pool import (
    ChunkedPinner,
    allocate_host_pool,
    cuda_host_register,
    cuda_host_unregister,
)
from data_plane.kv.tiered import KVCacheManager
from data_plane.models.loader import LoadedModel
from data_plane.transfer import make_transfer_engine
from shared.policy import Knobs, make_plan

log = structlog.get_logger(__name__)
DEFAULT_B_XFER_BLOCKS = 2400  # the paper's default when knobs.b_xfer is "auto" offline


@dataclass(slots=True)
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Serving:
    """How a serving worker's engine differs from an offline one, fixed at construction: its
    planner (the worker's hybrid local/remote planner), unix-second clock (the wire's times),
    columnar snapshots kept for the wire, and no tokenizer (text is the gateway's job)."""

    planner: Planner
    clock: Callable[[], float] = time.time


def build_engine(
    loaded: LoadedModel,
    config: EngineConfig,
    knobs: Knobs | None = None,
    serving: Serving | None = None,
) -> Engine:
    """An engine over ``loaded`` with its KV tiers sized by ``config``: offline (the policy of
    ``knobs`` planned in process, the model's tokenizer; without knobs vLLM's, as ``superinfer
    generate``'s default: a batch has no SLOs to rank by) or, with ``serving``, wired for the
    worker once and for all."""
    knobs = knobs or Knobs(policy="vllm")
    if torch.device(config.device).type == "cuda":
        # Triton launches, graph capture and the staging event use the current device
        torch.cuda.set_device(torch.device(config.device))
    model_cfg = loaded.config
    geometry = KVGeometry(
        model_cfg.num_layers,
        config.block_size,
        model_cfg.num_kv_heads,
        model_cfg.head_dim,
        model_cfg.dtype,
    )
    runner = ModelRunner(
        loaded.model,
        config.block_size,
        config.device,
        max_graph_batch=graph_batch_limit(
            model_cfg,
            config.max_num_seqs,
            int(device_total_bytes(torch.device(config.device)) * GRAPH_MEMORY_FRACTION),
        ),
    )
    num_blocks, how = size_hbm_pool(config, geometry, runner, model_cfg.vocab_size)
    max_model_len = validate_max_model_len(
        config.max_model_len, model_cfg.max_position_embeddings, num_blocks, config.block_size
    )
    log.info(
        "kv_pool_sized",
        num_hbm_blocks=num_blocks,
        hbm_kv_gib=round(num_blocks * geometry.block_bytes / 2**30, 3),
        max_model_len=max_model_len,
        decided_by=how,
    )
    kv_tensor = geometry.allocate(num_blocks, config.device)
    capture_graphs(runner, kv_tensor)
    kv = build_kv_manager(geometry, kv_tensor, config, knobs)
    return Engine(
        executor=ModelExecutor(runner, kv_tensor),
        kv=kv,
        planner=serving.planner if serving else lambda snapshot: make_plan(snapshot, knobs),
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        max_model_len=max_model_len,
        eos_token_ids=model_cfg.eos_token_ids,
        tokenizer=None if serving else loaded.tokenizer,
        clock=serving.clock if serving else time.monotonic,
        vocab_size=model_cfg.vocab_size,
        columnar=serving is not None,  # the worker's planner works on columns
        keep_columns=serving is not None,  # the wire snapshot, from the queues' columns
        grammars=Grammars(loaded.tokenizer, model_cfg.vocab_size, model_cfg.eos_token_ids),
    )


def capture_graphs(runner: ModelRunner, kv_tensor: torch.Tensor) -> None:
    """Every decode graph captured before the engine serves (none off CUDA), logged with the
    time and device memory it took."""
    if runner.graphs is None:
        return
    torch.cuda.empty_cache()  # capture empties the cache: count from an empty one
    start, before = time.perf_counter(), torch.cuda.memory_reserved(runner.device)
    num_captured = runner.capture_graphs(kv_tensor)
    log.info(
        "cuda_graphs_captured",
        num_graphs=num_captured,
        largest_batch=runner.graphs.sizes[-1],
        seconds=round(time.perf_counter() - start, 2),
        reserved_gib=round((torch.cuda.memory_reserved(runner.device) - before) / 2**30, 3),
    )


def build_kv_manager(
    geometry: KVGeometry, hbm: torch.Tensor, config: EngineConfig, knobs: Knobs
) -> KVCacheManager:
    """HBM only, or HBM + DRAM with a DuplexKV transfer engine when a DRAM pool is set."""
    num_dram = config.num_dram_blocks
    if num_dram is None:
        num_dram = geometry.blocks_in(config.dram_kv_gib)
    if num_dram == 0:
        return KVCacheManager.hbm_only(hbm.shape[0], config.block_size, config.prefix_caching)
    pinner = None
    num_ready = num_dram
    if not hbm.is_cuda:
        dram = geometry.allocate(num_dram, "cpu")
    else:  # pin in chunks in the background; serve with what is pinned so far
        dram = allocate_host_pool(num_dram, geometry.block_shape, geometry.dtype)
        chunk_blocks = max(1, geometry.blocks_in(config.pin_chunk_gib))
        device = hbm.device.index  # the pinner thread and finalizer run on the worker's GPU
        pinner = ChunkedPinner(
            dram,
            chunk_blocks,
            functools.partial(cuda_host_register, device=device),
            functools.partial(cuda_host_unregister, device=device),
        )
        num_ready = pinner.pin_first_chunk()
        pinner.start()
    transfer = make_transfer_engine(config.transfer_backend, hbm, dram)
    b_xfer = knobs.b_xfer if knobs.b_xfer is not None else DEFAULT_B_XFER_BLOCKS
    return KVCacheManager(
        hbm.shape[0],
        num_dram,
        config.block_size,
        transfer,
        b_xfer_blocks=b_xfer,
        eager_sync=config.eager_sync,
        num_dram_blocks_ready=num_ready,
        pinner=pinner,
        prefix_caching=config.prefix_caching,
        dram_prefix_caching=config.dram_prefix_caching,
    )


def generate(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[GenerationResult]:
    """Serve every prompt together; a prompt the engine refuses fails alone."""
    results: dict[str, GenerationResult] = {}
    for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        request_id = f"gen-{index}"
        results[request_id] = GenerationResult(prompt, [], "", "")
        try:
            engine.add_request(request_id, prompt, p)
        except RequestError as exc:
            results[request_id].finish_reason = FinishReason.ERROR.value
            results[request_id].error = str(exc)
    while engine.has_unfinished():
        for output in engine.step().outputs:
            result = results[output.request_id]
            result.token_ids.extend(output.new_token_ids)
            result.text += output.text_delta
            if output.finish_reason is not None:
                result.finish_reason = output.finish_reason.value
    return list(results.values())


def warm_up(engine: Engine) -> None:
    """One short request through the whole engine (first-call costs paid before serving);
    it leaves nothing behind: its blocks are freed when it finishes."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("warm-up", [0] * 8, params)
    while engine.has_unfinished():
        engine.step()
