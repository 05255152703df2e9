"""A held-out trace for the scheduling judgments: a workload no default was tuned on.

sched_compare's defaults were chosen on the kit's four traces. This writes a fifth that shares
none of their length tables or arrival logs, as a Mooncake-format JSONL (real arrival times,
so ``bench/sched_compare.py --trace FILE`` rescales its gaps to each rate and keeps its burst
shape):

- prompts from a mixture no kit trace has: chat (log-normal, median ``--chat-median``
  tokens), retrieval-augmented (log-normal, median 4x that) and long documents (uniform
  6k-12k tokens), weights ``--mix``; outputs log-normal (median ``--output-median``), clipped
  to 8..2,048;
- arrivals from a Hawkes process (``lab/arrivals.py``, branching ``--branching``): bursts
  correlated in time, not Poisson;
- regrouped into conversations (``lab/sessions.py``: ``--turns`` turns, each prompt carrying
  the conversation so far, capped at 16k tokens), as agents and chat clients send them.

    .venv/bin/python bench/heldout_trace.py --out /tmp/heldout.jsonl [--seed 7]
    .venv/bin/python bench/sched_compare.py --trace /tmp/heldout.jsonl --no-ablation ...

Ends with ``RESULT heldout_trace`` (the mix's mean and median lengths).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lab.arrivals import hawkes_arrivals
from lab.sessions import conversations
from lab.traces import TraceRequest

MAX_OUTPUT = 2048
MIN_OUTPUT = 8
LONG_DOC = (6144, 12288)
MAX_PROMPT = 16384


def sample_lengths(
    num: int, mix: Sequence[float], chat_median: int, output_median: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths of ``num`` requests (see the module docstring)."""
    weights = np.asarray(mix, dtype=np.float64)
    if weights.shape != (3,) or (weights < 0).any() or not weights.sum() > 0:
        raise ValueError(f"--mix needs three weights >= 0 with a positive sum, got {mix}")
    kind = rng.choice(3, size=num, p=weights / weights.sum())
    chat = rng.lognormal(np.log(chat_median), 0.8, num)
    rag = rng.lognormal(np.log(4 * chat_median), 0.5, num)
    doc = rng.uniform(*LONG_DOC, num)
    prompts = np.choose(kind, [chat, rag, doc]).round().clip(1, MAX_PROMPT).astype(np.int64)
    outputs = rng.lognormal(np.log(output_median), 0.9, num).round()
    return prompts, outputs.clip(MIN_OUTPUT, MAX_OUTPUT).astype(np.int64)


def heldout_requests(args: argparse.Namespace) -> list[TraceRequest]:
    rng = np.random.default_rng(args.seed)
    arrivals = hawkes_arrivals(1.0, args.branching, 1.0, rng, None, args.num_requests)
    prompts, outputs = sample_lengths(
        len(arrivals), args.mix, args.chat_median, args.output_median, rng
    )
    base = [
        TraceRequest(float(t), int(p), int(o))
        for t, p, o in zip(arrivals, prompts, outputs, strict=True)
    ]
    return conversations(
        base, turns=args.turns, think_s=10.0, max_prompt_len=MAX_PROMPT, seed=args.seed
    )


def write_jsonl(requests: Sequence[TraceRequest], path: Path) -> None:
    """Mooncake's format: ``timestamp`` in ms, ``input_length``, ``output_length``."""
    with path.open("w", encoding="utf-8") as f:
        for r in requests:
            row = {"timestamp": round(r.arrival_s * 1e3, 3), "input_length": r.input_len}
            f.write(json.dumps(row | {"output_length": r.output_len}) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", type=Path, required=True, help="the JSONL file to write")
    add("--seed", type=int, default=7)
    add("--num-requests", type=int, default=8000)
    add("--mix", type=float, nargs=3, default=[0.6, 0.3, 0.1], help="chat, RAG, long documents")
    add("--chat-median", type=int, default=600, help="chat prompts' median tokens")
    add("--output-median", type=int, default=250)
    add("--branching", type=float, default=0.5, help="Hawkes branching ratio (0: Poisson)")
    add("--turns", type=int, default=3, help="turns per conversation (1: none)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    requests = heldout_requests(args)
    write_jsonl(requests, args.out)
    prompts = np.array([r.input_len for r in requests])
    outputs = np.array([r.output_len for r in requests])
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    print(
        f"RESULT heldout_trace num_requests={len(requests)} prompt_mean={prompts.mean():.0f} "
        f"prompt_median={np.median(prompts):.0f} output_mean={outputs.mean():.0f} "
        f"output_median={np.median(outputs):.0f} span_s={span_s:.0f} out={args.out}"
    )


if __name__ == "__main__":
    main()
