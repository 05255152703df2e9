"""Useful output tokens/s: our engine (continuous batching) vs transformers (static batches).

One random Llama (hidden 512, 8 layers, 8 heads, 2 KV heads, vocab 32000), the same 64 seeded
requests (prompts 32-512 tokens, outputs 16-256 tokens, greedy, EOS ignored). transformers
serves them as a static server: `generate` on left-padded batches of 16 in arrival order, each
batch running until its longest request is done (tokens past a request's own length are not
counted). Ours serves all 64 at once. Both run in ``--dtype`` (default float32, the
checkpoint's; bfloat16 casts both). ``--rounds`` rounds alternate the order (ours then
transformers, then transformers then ours, ...), each with the load average; the RESULT's ratio
is the median of the rounds' ratios (min and max beside it).

    .venv/bin/python bench/engine_cpu.py [--num-requests 64] [--rounds 2] [--threads N]
        [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def build_checkpoint(directory: str) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def make_requests(num: int, seed: int) -> list[tuple[list[int], int]]:
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(num):
        prompt_len = int(torch.randint(32, 513, (1,), generator=generator))
        output_len = int(torch.randint(16, 257, (1,), generator=generator))
        prompt = torch.randint(3, 32000, (prompt_len,), generator=generator).tolist()
        requests.append((prompt, output_len))
    return requests


@torch.inference_mode()
def run_hf(model: torch.nn.Module, requests: list[tuple[list[int], int]], batch: int) -> float:
    start = time.perf_counter()
    for index in range(0, len(requests), batch):
        group = requests[index : index + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(group):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(n for _, n in group)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - start


def run_ours(
    directory: str, requests: list[tuple[list[int], int]], dtype: str
) -> tuple[float, dict]:
    from data_plane.engine.config import EngineConfig
    from data_plane.engine.llm import build_engine, generate
    from data_plane.engine.sampling import SamplingParams
    from data_plane.models import load_model

    loaded = load_model(directory, dtype=dtype)
    engine = build_engine(loaded, EngineConfig(max_num_batched_tokens=2048, hbm_kv_gib=1.0))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    results = generate(engine, [p for p, _ in requests], params)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.token_ids) for r in results)
    expected = sum(n for _, n in requests)
    if produced != expected:
        raise RuntimeError(f"engine produced {produced} tokens, expected {expected}")
    stats = engine.stats
    split = {
        "iterations": stats.num_iterations,
        "ms_per_iter": 1e3 * stats.step_time_s / stats.num_iterations,
        "model_ms_per_iter": 1e3 * stats.model_time_s / stats.num_iterations,
        "overhead_ms_per_iter": 1e3
        * (stats.step_time_s - stats.model_time_s)
        / stats.num_iterations,
    }
    return elapsed, split


def run_round(
    index: int,
    directory: str,
    model: torch.nn.Module,
    requests: list[tuple[list[int], int]],
    dtype: str,
) -> dict:
    """One round, ours first on even rounds and transformers first on odd ones."""
    useful = sum(n for _, n in requests)
    load = os.getloadavg()[0]
    if index % 2 == 0:
        ours_s, split = run_ours(directory, requests, dtype)
        hf_s = run_hf(model, requests, batch=16)
    else:
        hf_s = run_hf(model, requests, batch=16)
        ours_s, split = run_ours(directory, requests, dtype)
    row = {"ours_tok_s": useful / ours_s, "hf_tok_s": useful / hf_s, "load": load, **split}
    row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
    print(
        f"round {index}: ours {row['ours_tok_s']:.1f} tok/s  transformers {row['hf_tok_s']:.1f}"
        f" tok/s  ratio {row['ratio']:.2f}  load {load:.2f}  "
        + "  ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in split.items()
        ),
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    requests = make_requests(args.num_requests, args.seed)
    print(
        f"requests={len(requests)} useful_output_tokens={sum(n for _, n in requests)} "
        f"torch={torch.__version__} threads={torch.get_num_threads()} dtype={args.dtype}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as directory:
        model = build_checkpoint(directory).to(getattr(torch, args.dtype))
        rows = [run_round(i, directory, model, requests, args.dtype) for i in range(args.rounds)]
    ratios = [row["ratio"] for row in rows]

    def median(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    print(
        f"RESULT engine_cpu ratio={statistics.median(ratios):.2f} ratio_min={min(ratios):.2f} "
        f"ratio_max={max(ratios):.2f} ours_tok_s={median('ours_tok_s'):.1f} "
        f"hf_tok_s={median('hf_tok_s'):.1f} model_ms_per_iter={median('model_ms_per_iter'):.2f} "
        f"overhead_ms_per_iter={median('overhead_ms_per_iter'):.2f} rounds={len(rows)} "
        f"dtype={args.dtype} load_mean={statistics.mean(row['load'] for row in rows):.2f}"
    )


if __name__ == "__main__":
    main()
