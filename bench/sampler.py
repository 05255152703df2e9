"""The sampler's time per step: the batched sampler (data_plane/engine/sampler.py) against the
per-row one it replaced (kept here as it was at commit 5e17ac3: each sampled row's logits
copied to the host, softmax, sort and multinomial one row at a time), alternated A, B, A, B in
this process at batch 1/16/64 x vocabulary 32k/128k, for greedy, temperature 1 and temperature
1 with top-p 0.9 (half the rows seeded). Then what the batched sampler adds, against the same
call without it: the three penalties over 512 prompt and 256 output tokens a row, and a
structured-output bitmask (xgrammar's apply, 1 % of the vocabulary allowed: the mask's fill is
bench/grammar_masks.py's). CPU here; the GPU run is bench/gpu's.

    .venv/bin/python bench/sampler.py [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from data_plane.engine.sampler import GREEDY_BELOW_TEMPERATURE, Sampler
from data_plane.engine.sampling import SamplingRow
from shared.sampling import SamplingParams

_SEED_MIX = 1_000_003
_SEED_MASK = (1 << 63) - 1


class RowSampler:
    """The sampler before the batched one (the baseline)."""

    def __init__(self) -> None:
        self.generator = torch.Generator()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        greedy = [i for i, r in enumerate(rows) if r.params.temperature < GREEDY_BELOW_TEMPERATURE]
        tokens = [0] * len(rows)
        if greedy:
            for i, token in zip(greedy, logits[greedy].argmax(dim=-1).tolist(), strict=True):
                tokens[i] = int(token)
        for i, row in enumerate(rows):
            if row.params.temperature >= GREEDY_BELOW_TEMPERATURE:
                tokens[i] = self._sample_row(logits[i], row)
        return tokens

    def _sample_row(self, logits: torch.Tensor, row: SamplingRow) -> int:
        params = row.params
        scaled = logits.float().cpu() / params.temperature
        if params.top_k is not None and params.top_k < scaled.numel():
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(0) - sorted_probs > params.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        generator = self.generator
        if params.seed is not None:
            generator = torch.Generator().manual_seed(
                (params.seed * _SEED_MIX + row.output_index) & _SEED_MASK
            )
        return int(torch.multinomial(probs, 1, generator=generator).item())


MODES = {
    "greedy": {"temperature": 0.0},
    "t1": {"temperature": 1.0},
    "t1_top_p": {"temperature": 1.0, "top_p": 0.9},
}


def _time_ms(sampler: Sampler | RowSampler, logits: torch.Tensor, rows: list[SamplingRow]) -> float:
    """Mean ms per call over at least 3 calls and 0.2 s."""
    sampler.sample(logits, rows)  # warm
    calls, t0 = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - t0 < 0.2:
        sampler.sample(logits, rows)  # returns host ints: synchronized
        calls += 1
    return (time.perf_counter() - t0) / calls * 1e3


def _mask_ms(logits: torch.Tensor, bitmask: torch.Tensor) -> float:
    """ms per structured-output mask: the logits copied (the raw ones stay for logprobs) and
    the bitmask applied, as data_plane/engine/structured.py does (the fill is not included:
    bench/grammar_masks.py)."""
    import xgrammar

    calls, t0 = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - t0 < 0.2:
        masked = logits.clone()
        xgrammar.apply_token_bitmask_inplace(masked, bitmask)
        float(masked[0, 0])  # synchronized
        calls += 1
    return (time.perf_counter() - t0) / calls * 1e3


def _extras(device: torch.device, repeats: int) -> dict[str, float]:
    """ms added at batch 64 x 128k (top-p 0.9) by the penalties and by a bitmask."""
    batch, vocab = 64, 128_000
    logits = torch.randn(batch, vocab, device=device)
    base = SamplingParams(max_tokens=512, temperature=1.0, top_p=0.9)
    penalized = SamplingParams(max_tokens=512, temperature=1.0, top_p=0.9, presence_penalty=0.5,
                               frequency_penalty=0.5, repetition_penalty=1.1)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (512,), generator=generator).tolist()
    output = torch.randint(0, vocab, (256,), generator=generator).tolist()
    plain = [SamplingRow(base, 256) for _ in range(batch)]
    with_penalties = [SamplingRow(penalized, 256, (), prompt, output) for _ in range(batch)]
    allowed = torch.zeros(batch, vocab, dtype=torch.bool)
    allowed[:, ::100] = True
    bits = allowed.view(batch, -1, 32) if vocab % 32 == 0 else None
    assert bits is not None
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    bitmask = ((bits.long() * weights).sum(-1) & 0xFFFFFFFF).to(torch.int32)
    found: dict[str, list[float]] = {"base": [], "penalties": [], "mask": []}
    for _ in range(repeats):
        found["base"].append(_time_ms(Sampler(), logits, plain))
        found["penalties"].append(_time_ms(Sampler(), logits, with_penalties))
        found["mask"].append(_mask_ms(logits, bitmask.to(device)))
    base_ms = statistics.median(found["base"])
    out = {
        "penalties": statistics.median(found["penalties"]) - base_ms,
        "mask": statistics.median(found["mask"]),
    }
    print(
        f"batch 64 x 128k, top-p 0.9: {base_ms:.1f} ms; the penalties add {out['penalties']:.1f}"
        f" ms, a structured-output bitmask {out['mask']:.1f} ms"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="A/B pairs per case")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--quick", action="store_true", help="batch 1 and 16 x 32k, no extras (a smoke run)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    load_start = os.getloadavg()[0]
    ratios: dict[str, float] = {}
    print(f"{'mode':>9} {'batch':>5} {'vocab':>6} {'old ms':>9} {'new ms':>9} {'old/new':>8}")
    batches, vocabs = ((1, 16), (32_000,)) if args.quick else ((1, 16, 64), (32_000, 128_000))
    for mode, fields in MODES.items():
        for batch in batches:
            for vocab in vocabs:
                logits = torch.randn(batch, vocab, device=device)
                params = [SamplingParams(max_tokens=64, **fields) for _ in range(batch)]  # type: ignore[arg-type]
                seeded = SamplingParams(max_tokens=64, seed=7, **fields)  # type: ignore[arg-type]
                rows = [SamplingRow(seeded if i % 2 else p, 3) for i, p in enumerate(params)]
                old_ms, new_ms = [], []
                for _ in range(args.repeats):
                    old_ms.append(_time_ms(RowSampler(), logits, rows))
                    new_ms.append(_time_ms(Sampler(), logits, rows))
                old, new = statistics.median(old_ms), statistics.median(new_ms)
                ratios[f"{mode}_b{batch}_v{vocab // 1000}k"] = old / new
                print(f"{mode:>9} {batch:>5} {vocab:>6} {old:>9.2f} {new:>9.2f} {old / new:>8.1f}")
    extras = {"penalties": float("nan"), "mask": float("nan")}
    if not args.quick:
        extras = _extras(device, args.repeats)
    load_end = os.getloadavg()[0]
    worst = min(ratios, key=ratios.__getitem__)
    big = "b16_v32k" if args.quick else "b64_v128k"
    print(
        f"RESULT sampler device={device.type} speedup_t1_{big}={ratios[f't1_{big}']:.1f} "
        f"speedup_top_p_{big}={ratios[f't1_top_p_{big}']:.1f} "
        f"worst_speedup={ratios[worst]:.2f} worst_case={worst} "
        f"penalties_ms_b64_v128k={extras['penalties']:.1f} mask_ms_b64_v128k={extras['mask']:.1f} "
        f"load_avg={load_start:.2f}-{load_end:.2f}"
    )


if __name__ == "__main__":
    main()
