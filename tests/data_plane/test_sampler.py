"""The batched sampler against the distributions it must draw from (transformers' warpers in
vLLM's order, and cases where that order decides), and its guarantees: greedy exact, seeded rows
reproducible whatever the batch, stop tokens never drawn under min_tokens."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from data_plane.engine.penalties import apply_penalties
from data_plane.engine.sampler import Sampler, _filtered_probs
from data_plane.engine.sampling import SamplingRow
from shared.sampling import SamplingParams

VOCAB = 12


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _row(output_index: int = 0, suppressed: tuple[int, ...] = (), **params: object) -> SamplingRow:
    return SamplingRow(SamplingParams(max_tokens=64, **params), output_index, suppressed)  # type: ignore[arg-type]


def _frequencies(logits: torch.Tensor, row: SamplingRow, num_draws: int) -> torch.Tensor:
    """Each token's share of ``num_draws`` draws of one row (drawn as a batch of copies)."""
    sampler = Sampler()
    counts = torch.zeros(VOCAB)
    batch = 400
    for _ in range(num_draws // batch):
        tokens = sampler.sample(logits.expand(batch, VOCAB), [row] * batch)
        counts += torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    return counts / counts.sum()


def _reference(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float,
               min_p: float) -> torch.Tensor:  # fmt: skip
    """The target distribution: transformers' warpers, in vLLM's order (temperature, min-p,
    top-k, top-p)."""
    scores = (logits.double() / temperature).unsqueeze(0)
    ids = torch.zeros(1, 1, dtype=torch.long)
    if min_p > 0.0:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return torch.softmax(scores[0], dim=-1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, None, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, None, 0.8, 0.0),
        (1.0, 8, 0.9, 0.1),
        (1.0, None, 0.6, 0.15),
    ],
)
def test_draws_follow_the_filtered_distribution(
    temperature: float, top_k: int | None, top_p: float, min_p: float
) -> None:
    logits = _logits(1, seed=3)[0]
    row = _row(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    target = _reference(logits, temperature, top_k, top_p, min_p)
    seen = _frequencies(logits, row, 40_000)
    assert torch.all(seen[target == 0] == 0), "a filtered-out token was drawn"
    assert float((seen - target.float()).abs().max()) < 0.012  # ~5 sigma at 40k draws


def test_greedy_is_exact_and_mixed_batches_keep_it() -> None:
    logits = _logits(6, seed=1)
    rows = [_row(temperature=0.0 if i % 2 == 0 else 1.0, seed=i) for i in range(6)]
    tokens = Sampler().sample(logits, rows)
    assert [tokens[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(dim=-1).tolist()
    assert Sampler().sample(logits, [_row(temperature=0.0)] * 6) == logits.argmax(-1).tolist()


def test_a_seeded_row_draws_the_same_whatever_the_batch() -> None:
    logits = _logits(8, seed=2)
    alone = [Sampler().sample(logits[3:4], [_row(seed=42, output_index=i)])[0] for i in range(8)]
    in_batch = []
    for i in range(8):
        rows = [_row(output_index=i) for _ in range(8)]
        rows[3] = _row(seed=42, output_index=i)
        shuffled = torch.cat([logits[:3], logits[3:4], logits[4:]])
        in_batch.append(Sampler().sample(shuffled, rows)[3])
    assert alone == in_batch
    assert len(set(alone)) > 1  # the output position changes the draw


def test_stop_tokens_are_never_drawn_while_suppressed() -> None:
    logits = _logits(4, seed=4)
    favourite = int(logits[0].argmax())
    rows = [_row(temperature=0.0, suppressed=(favourite,)), _row(suppressed=(favourite, 0))]
    rows += [_row(temperature=0.0), _row()]
    for _ in range(50):
        tokens = Sampler().sample(logits[[0, 0, 0, 0]], rows)
        assert tokens[0] != favourite and tokens[1] not in (favourite, 0)
        assert tokens[2] == favourite


def test_min_tokens_suppression_follows_the_output_position() -> None:
    params = SamplingParams(max_tokens=8, min_tokens=3)
    assert SamplingRow.of(params, [1], [5, 6], (7, 9)).suppressed_ids == (7, 9)
    assert SamplingRow.of(params, [1], [5, 6, 7], (7, 9)).suppressed_ids == ()


def test_penalties_match_transformers_and_openai_formulas() -> None:
    """Repetition penalty as transformers' RepetitionPenaltyLogitsProcessor computes it over
    prompt + output; presence/frequency as OpenAI documents them over the output; logit_bias
    added. Greedy picks from the penalized logits."""
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = _logits(3, seed=5)
    prompt, output = [1, 2, 3], [4, 4, 5]
    rep = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.7)
    pen = SamplingParams(max_tokens=8, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.8)
    bias = SamplingParams(
        max_tokens=8, temperature=0.0, logit_bias_ids=(7, 2), logit_bias_values=(100.0, -1.0)
    )
    rows = [SamplingRow.of(p, prompt, output, ()) for p in (rep, pen, bias)]
    got = apply_penalties(logits, rows)
    ids = torch.tensor([prompt + output])
    expected_rep = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits[0:1].clone())[0]
    torch.testing.assert_close(got[0], expected_rep)
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    expected_pen = logits[1] - 0.8 * counts - 0.5 * (counts > 0).float()
    torch.testing.assert_close(got[1], expected_pen)
    expected_bias = logits[2].clone()
    expected_bias[7] += 100.0
    expected_bias[2] -= 1.0
    torch.testing.assert_close(got[2], expected_bias)
    assert Sampler().sample(logits, rows)[2] == 7
    plain = [SamplingRow.of(SamplingParams(max_tokens=8), prompt, output, ())]
    assert plain[0].prompt_ids == ()  # rows without penalties carry no token lists
    assert torch.equal(apply_penalties(logits[:1], plain), logits[:1])


def test_vllms_order_min_p_before_top_p_and_bias_before_penalties() -> None:
    """Where the order decides: min-p cuts before top-p measures its mass (vLLM's argmax-
    invariant processors run before top-k/top-p), and logit_bias is added before the
    repetition penalty divides (vLLM's logits processors before its penalties)."""
    probs = torch.tensor([0.5, 0.3, 0.1, 0.1] + [0.0] * (VOCAB - 4))
    logits = probs.clamp_min(1e-30).log()
    row = _row(min_p=0.3, top_p=0.6)  # min-p leaves (.625, .375); top-p 0.6 then keeps one
    assert _frequencies(logits, row, 2_000)[0] == 1.0
    biased = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        repetition_penalty=2.0,
        logit_bias_ids=(1,),
        logit_bias_values=(4.0,),
    )
    rows = [SamplingRow.of(biased, [1], [], ())]  # token 1 in the prompt: (0 + 4) / 2 < 3
    assert Sampler().sample(torch.tensor([[3.0, 0.0] + [-9.0] * (VOCAB - 2)]), rows) == [0]


def test_top_k_keeps_ties_and_top_p_one_keeps_the_whole_tail() -> None:
    """top-k cuts below the k-th largest logit, so tokens tied with it stay (vLLM's and
    transformers' rule); a row with top-p 1 keeps every token of non-zero probability even
    beside a top-p row over a 128k vocabulary (a float32 running sum passes 1 there)."""
    tied = torch.tensor([1.0, 1.0, 1.0] + [0.0] * (VOCAB - 3))
    seen = _frequencies(tied, _row(top_k=1), 6_000)
    assert torch.all(seen[:3] > 0.28) and float(seen[3:].sum()) == 0.0
    vocab = 128_256
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(7)) * 3
    rows = [_row(), _row(top_p=0.9)]
    batched = _filtered_probs(logits, rows, [False, False])[0]
    assert torch.equal(batched > 0, torch.softmax(logits[0], dim=-1) > 0)
