"""Log-probabilities from the engine against an independent reference: transformers'
``log_softmax`` of the same checkpoint on the same tokens (fp32, max abs difference <= 1e-3),
for sampled tokens (with their top-N) and prompt tokens, across chunked prefill, a shared
prefix (a prompt_logprobs request takes no cache hit), batching with requests that ask for
none, and preemption by recompute (prompt logprobs go out once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data_plane.engine.config import EngineConfig
from data_plane.engine.engine import Engine
from data_plane.engine.llm import build_engine
from data_plane.engine.logprobs import token_logprobs
from data_plane.engine.sampling import SamplingParams
from data_plane.models import load_model
from shared.logprobs import TokenLogprobs, concat
from tests.data_plane.hf_models import build_hf_model

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    directory = tmp_path_factory.mktemp("llama3")
    return build_hf_model("llama3", directory), directory


def _reference(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """log_softmax at every position of ``token_ids`` (row p: the distribution of token p+1)."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    out: dict[str, dict] = {rid: {"tokens": [], "lp": [], "prompt": None} for rid in requests}
    while engine.has_unfinished():
        for output in engine.step().outputs:
            record = out[output.request_id]
            record["tokens"].extend(output.new_token_ids)
            if output.logprobs is not None:
                record["lp"].append(output.logprobs)
            if output.prompt_logprobs is not None:
                assert record["prompt"] is None, "prompt logprobs went out twice"
                record["prompt"] = output.prompt_logprobs
    return out


def _check(values: TokenLogprobs, reference: torch.Tensor, targets: list[int], n: int) -> None:
    assert len(values) == len(targets) == reference.shape[0]
    expected = reference.gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1)
    got = torch.tensor(values.logprobs)
    assert (got - expected).abs().max().item() <= TOLERANCE
    lowest = 1 + (reference > expected.unsqueeze(1) + TOLERANCE).sum(dim=1)  # ties within it
    highest = 1 + (reference > expected.unsqueeze(1) - TOLERANCE).sum(dim=1)
    for rank, low, high in zip(values.ranks, lowest.tolist(), highest.tolist(), strict=True):
        assert low <= rank <= high
    top_values, _ = reference.topk(n, dim=-1)
    for row, (ids, logprobs) in enumerate(zip(values.top_ids, values.top_logprobs, strict=True)):
        assert len(ids) == len(logprobs) == n
        pairs = zip(logprobs, top_values[row].tolist(), strict=True)
        assert max((abs(a - b) for a, b in pairs), default=0.0) <= TOLERANCE
        ref_of_ids = reference[row, ids]  # the ids returned are those values' tokens
        assert all(
            abs(a - b) <= TOLERANCE for a, b in zip(ref_of_ids.tolist(), logprobs, strict=True)
        )


@pytest.mark.parametrize("chunk", [8, 512])
def test_sampled_and_prompt_logprobs_match_transformers(
    checkpoint: tuple[torch.nn.Module, Path], chunk: int
) -> None:
    model, directory = checkpoint
    config = EngineConfig(block_size=4, num_hbm_blocks=256, max_num_batched_tokens=chunk)
    engine = build_engine(load_model(str(directory)), config)
    prompt = [1, *range(10, 40)]
    asks = SamplingParams(max_tokens=6, temperature=0.8, seed=7, ignore_eos=True, logprobs=3,
                          prompt_logprobs=2)  # fmt: skip
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = _run(engine, {"plain": (prompt, plain), "asks": (prompt, asks)})
    assert not out["plain"]["lp"] and out["plain"]["prompt"] is None  # asked for none
    record = out["asks"]
    reference = _reference(model, prompt + record["tokens"])
    sampled = concat(record["lp"])
    num_prompt = len(prompt)
    _check(sampled, reference[num_prompt - 1 : -1], record["tokens"], 3)
    _check(record["prompt"], reference[: num_prompt - 1], prompt[1:], 2)


def test_prompt_logprobs_go_out_once_across_preemption(
    checkpoint: tuple[torch.nn.Module, Path],
) -> None:
    """A pool too small for both requests: one is preempted (recomputed) mid-prefill or
    later; its prompt logprobs still cover every prompt token once, and equal the reference."""
    model, directory = checkpoint
    config = EngineConfig(block_size=4, num_hbm_blocks=16, max_num_batched_tokens=8)
    engine = build_engine(load_model(str(directory)), config)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    prompts = {f"r{i}": ([1, *range(20 + i, 60 + i)], params) for i in range(2)}
    out = _run(engine, prompts)
    assert engine.stats.num_preemptions > 0
    for request_id, (prompt, _) in prompts.items():
        values = out[request_id]["prompt"]
        reference = _reference(model, prompt)
        _check(values, reference[:-1], prompt[1:], 0)


def test_a_prompt_logprobs_request_takes_no_prefix_hit(
    checkpoint: tuple[torch.nn.Module, Path],
) -> None:
    model, directory = checkpoint
    config = EngineConfig(block_size=4, num_hbm_blocks=256, prefix_caching=True)
    engine = build_engine(load_model(str(directory)), config)
    prompt = [1, *range(50, 90)]
    _run(engine, {"first": (prompt, SamplingParams(max_tokens=2, temperature=0.0))})
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    out = _run(engine, {"again": (prompt, params)})
    _check(out["again"]["prompt"], _reference(model, prompt)[:-1], prompt[1:], 1)


def test_a_tied_tokens_rank_counts_every_token_at_least_as_likely() -> None:
    """vLLM's rank: how many tokens have a log-probability >= the token's (ties counted)."""
    logits = torch.tensor([[1.0, 1.0, 0.0], [3.0, 1.0, 0.0]])
    assert token_logprobs(logits, [1, 0], [0, 0]).ranks == [2, 1]
