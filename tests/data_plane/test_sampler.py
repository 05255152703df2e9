"""The batched sampler against the distributions it must draw from, computed here directly
from the logits (softmax, sorted cut-offs), and its guarantees: greedy exact, seeded rows
reproducible whatever the batch, stop tokens never drawn under min_tokens."""

from __future__ import annotations

import math

import pytest
import torch

from data_plane.engine.penalties import apply_penalties
from data_plane.engine.sampler import Sampler
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
    """The target distribution, one filter at a time over the sorted tokens."""
    scaled = logits.double() / temperature
    order = scaled.argsort(descending=True).tolist()
    keep = set(order[: top_k or VOCAB])
    probs = torch.softmax(scaled.masked_fill(~_mask(keep), -math.inf), dim=-1)
    mass = 0.0
    for token in order:
        if token in keep and mass > top_p:
            keep.discard(token)
        mass += float(probs[token])
    probs = torch.softmax(scaled.masked_fill(~_mask(keep), -math.inf), dim=-1)
    probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _mask(tokens: set[int]) -> torch.Tensor:
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[list(tokens)] = True
    return mask


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, None, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, None, 0.8, 0.0), (1.0, 8, 0.9, 0.1)],
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
