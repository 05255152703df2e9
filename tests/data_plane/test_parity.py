"""Our engine vs transformers on random Llama-3 (rope scaling), Mistral (sliding window) and
Qwen2 (q/k/v bias, tied embeddings; and with its window on some layers) checkpoints: 8 prompts
in one batch, chunked prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from data_plane.engine.config import EngineConfig
from data_plane.engine.llm import build_engine, generate
from data_plane.engine.sampling import SamplingParams, SamplingRow
from data_plane.models import load_model
from tests.data_plane.hf_models import build_hf_model, hf_greedy

PROMPT_LENS = [3, 7, 12, 17, 21, 30, 36, 41]
NUM_NEW = 10


class RecordingSampler:
    """Wraps the sampler and keeps each request's first logits row."""

    def __init__(self, inner, store: dict[int, torch.Tensor]):
        self.inner = inner
        self.store = store

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        tokens = self.inner.sample(logits, rows)
        for index, row in enumerate(rows):
            if row.output_index == 0:
                self.store[row.params.seed or 0] = logits[index].clone()
        return tokens


@pytest.fixture(scope="module", params=["llama3", "mistral", "qwen2", "qwen2_swa"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp(request.param)
    model = build_hf_model(request.param, directory)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    reference = [hf_greedy(model, p, NUM_NEW) for p in prompts]
    return directory, prompts, reference


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_greedy_tokens_and_logits_match_transformers(checkpoint, block_size: int) -> None:
    directory, prompts, reference = checkpoint
    loaded = load_model(str(directory))
    config = EngineConfig(block_size=block_size, max_num_batched_tokens=32, num_hbm_blocks=4096)
    assert config.max_num_batched_tokens < max(PROMPT_LENS)  # chunked prefill is forced
    engine = build_engine(loaded, config)
    logits: dict[int, torch.Tensor] = {}
    runner = engine.executor.runner  # type: ignore[attr-defined]
    runner.sampler = RecordingSampler(runner.sampler, logits)
    # temperature 0 with a distinct "seed" per prompt only to key the recorded logits
    params = [
        SamplingParams(max_tokens=NUM_NEW, temperature=0, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    results = generate(engine, prompts, params)
    for index, (result, (ref_tokens, ref_logits)) in enumerate(
        zip(results, reference, strict=True)
    ):
        assert result.token_ids == ref_tokens, f"prompt {index} (len {len(prompts[index])})"
        torch.testing.assert_close(logits[index], ref_logits, rtol=1e-4, atol=1e-4)
    assert engine.kv.hbm.num_free == engine.kv.hbm.num_blocks
    assert engine.stats.num_skipped_chunks == 0


def test_config_fields_are_read(checkpoint) -> None:
    directory, _, _ = checkpoint
    cfg = load_model(str(directory)).config
    family = Path(directory).name.rstrip("0123456789")
    if family == "llama3":
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    if family == "mistral":
        assert cfg.sliding_window == 24
    if family == "qwen2":
        assert cfg.qkv_bias and cfg.tie_word_embeddings
    if family == "qwen2_swa":
        assert [cfg.window_of(i) for i in range(3)] == [None, 16, 16]


@torch.no_grad()
def test_penalized_greedy_matches_transformers_generate(checkpoint) -> None:
    """Greedy with repetition_penalty and with a logit_bias: the same tokens as transformers'
    generate with its RepetitionPenaltyLogitsProcessor / SequenceBiasLogitsProcessor, and not
    the unpenalized ones."""
    directory, prompts, reference = checkpoint
    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # min_new_tokens would mask EOS; vLLM does not
    loaded = load_model(str(directory))
    engine = build_engine(loaded, EngineConfig(block_size=16, num_hbm_blocks=4096))
    num_new = 16
    cases = [
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        ({"logit_bias_ids": (5,), "logit_bias_values": (4.0,)}, {"sequence_bias": {(5,): 4.0}}),
    ]
    for ours, theirs in cases:
        params = SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True, **ours)
        results = generate(engine, prompts[:4], [params] * 4)
        changed = 0
        for prompt, result, (plain, _) in zip(prompts, results, reference, strict=False):
            out = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=num_new,  # no EOS: EOS is drawn and not stopped at (ignore_eos)
                pad_token_id=0,
                **theirs,
            )
            assert result.token_ids == out[0, len(prompt) :].tolist(), (ours, prompt)
            changed += result.token_ids[: len(plain)] != plain
        assert changed, f"{ours} changed no continuation"
