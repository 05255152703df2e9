"""The engine on a CUDA device (marked gpu; skipped without one): the GPU data path (Triton
paged attention, CUDA graphs for decode batches) gives the same greedy tokens as the CPU
reference path, with DuplexKV rotation on the ``cuda`` transfer backend, and logits within bf16
tolerance of the CPU's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data_plane.engine.config import EngineConfig
from data_plane.engine.llm import build_engine, generate
from data_plane.engine.sampling import SamplingParams, SamplingRow
from data_plane.models import load_model
from shared.policy import Knobs
from tests.conftest import STORIES_REFERENCE_TOKENS
from tests.data_plane.test_duplexkv import RandomRotations

pytestmark = pytest.mark.gpu


class FirstLogits:
    """Wraps the sampler and keeps the logits each request sampled its first token from."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.rows: list[torch.Tensor] = []

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        for index, row in enumerate(rows):
            if row.output_index == 0:
                self.rows.append(logits[index].float().cpu())
        return self.inner.sample(logits, rows)


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in ("", "Tim had a dog", "The sun was hot", "One day")]


def _run(loaded, config: EngineConfig, planner=None) -> tuple[object, list[list[int]]]:
    engine = build_engine(loaded, config, Knobs(policy="vllm", b_xfer=16))
    if planner is not None:
        engine.planner = planner
    prompts = _prompts(loaded.tokenizer)
    params = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)] * len(prompts)
    results = generate(engine, prompts, params)
    if engine.kv.has_dram:
        engine.kv.drain()
    engine.close()
    return engine, [r.token_ids for r in results]


@pytest.mark.parametrize("name", ["stories", "tiny-random"])
def test_cuda_engine_matches_cpu_with_rotation(name: str, stories_path: Path) -> None:
    path = str(stories_path) if name == "stories" else "tiny-random"
    cpu_model = load_model(path, seed=3)
    _, reference = _run(cpu_model, EngineConfig(block_size=4, num_hbm_blocks=512))
    if name == "stories":
        assert reference[0][:16] == STORIES_REFERENCE_TOKENS
    gpu_model = load_model(path, device="cuda", seed=3)
    engine, plain = _run(gpu_model, EngineConfig(block_size=4, num_hbm_blocks=512, device="cuda"))
    assert plain == reference
    runner = engine.executor.runner  # type: ignore[attr-defined]
    assert runner.attention_backend == "triton"  # the GPU data path, not the torch fallback
    assert runner.graphs is not None and runner.graphs.num_replays > 0
    for seed in range(8):
        config = EngineConfig(
            block_size=4,
            num_hbm_blocks=40,
            num_dram_blocks=200,
            max_num_batched_tokens=16,
            device="cuda",
            transfer_backend="cuda",
        )
        engine, rotated = _run(gpu_model, config, RandomRotations(seed, 0.2, 0.3))
        assert rotated == reference, f"seed {seed}"
        kv = engine.kv  # type: ignore[attr-defined]
        assert engine.stats.num_rotations_out > 0  # type: ignore[attr-defined]
        assert kv.hbm.num_free == kv.hbm.num_blocks and kv.dram.num_free == kv.dram.num_blocks


def _first_logits(path: str, device: str) -> list[torch.Tensor]:
    loaded = load_model(path, dtype="bfloat16", device=device, seed=3)
    config = EngineConfig(
        block_size=16, num_hbm_blocks=256, max_num_batched_tokens=8, device=device
    )
    engine = build_engine(loaded, config, Knobs(policy="vllm"))
    runner = engine.executor.runner  # type: ignore[attr-defined]
    recorder = FirstLogits(runner.sampler)
    runner.sampler = recorder
    prompts = _prompts(loaded.tokenizer)
    params = [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)] * len(prompts)
    generate(engine, prompts, params)  # chunks of 8: prompts are prefilled over several steps
    engine.close()
    return recorder.rows


@pytest.mark.parametrize("name", ["stories", "tiny-random"])
def test_bf16_logits_match_cpu(name: str, stories_path: Path) -> None:
    path = str(stories_path) if name == "stories" else "tiny-random"
    cpu_rows = _first_logits(path, "cpu")
    gpu_rows = _first_logits(path, "cuda")
    assert len(cpu_rows) == len(gpu_rows) == 4
    for cpu, gpu in zip(cpu_rows, gpu_rows, strict=True):
        scale = float(cpu.abs().max())
        torch.testing.assert_close(gpu, cpu, rtol=0.05, atol=0.05 * scale)
