"""`superinfer bench` requests: a trace turned into prompts of the trace's input lengths in the
served model's tokenizer, with SLO classes drawn from a mix."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lab.loadgen.core import PlannedRequest, ServerInfo
from lab.traces import TraceRequest
from shared.model_source import default_model, model_display_name
from shared.tokenizer import (
    HFTokenizer,
    Llama2cTokenizer,
    Tokenizer,
    TokenizerNotFoundError,
    load_tokenizer_bundle,
)

# fmt: off
_WORDS = (
    "the", "a", "cat", "dog", "sun", "big", "red", "day", "was", "and", "she", "he", "to", "of",
    "in", "it", "is", "on", "at", "for", "with", "play", "park", "ball", "tree", "happy",
    "little", "girl", "boy", "saw", "went", "home", "said", "time", "one", "they", "had", "not",
    "very", "friend", "blue", "box", "run", "jump", "sky", "fish", "bird", "cake", "toy", "mom",
    "dad", "water", "house", "good", "nice", "fun",
)
# fmt: on
_TAIL_TOKENS = 24  # the last tokens of a prompt are chosen to make its length exact


def load_bench_tokenizer(server: ServerInfo, tokenizer_path: str | None) -> Tokenizer:
    """``tokenizer_path`` (a model directory or file, ``tokenizer.json`` or a llama2.c
    ``tok*.bin``), else the served model by its ``/v1/models`` id or root (``tiny-random``, a
    local path, or the name ``make run``'s default model is served under). Never downloads."""
    if tokenizer_path is not None:
        if tokenizer_path.endswith(".json"):
            return HFTokenizer(_existing(tokenizer_path), None, ())
        name = tokenizer_path.rsplit("/", 1)[-1]
        if name.startswith("tok") and name.endswith(".bin"):
            return Llama2cTokenizer(_existing(tokenizer_path))
        return load_tokenizer_bundle(tokenizer_path).tokenizer
    default = default_model()
    served_default = default if model_display_name(default) == server.model else None
    for candidate in (server.model, server.root, served_default):
        if candidate:
            try:
                return load_tokenizer_bundle(candidate).tokenizer
            except TokenizerNotFoundError:
                continue
    raise ValueError(
        f"cannot find the tokenizer of the served model {server.model!r} (root {server.root!r});"
        " pass --tokenizer PATH (a model directory, llama2.c .bin, tokenizer.json or tok*.bin)"
    )


def _existing(path: str) -> Path:
    if not Path(path).is_file():
        raise ValueError(f"tokenizer file not found: {path}")
    return Path(path)


class PromptBuilder:
    """Texts of an exact token count (BOS included, as the server encodes a completion's
    prompt): random common words, the last few chosen from a table of exact fills. A word's
    cost is measured once in context, so building needs no full encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_base_tokens = len(tokenizer.encode("", add_bos=True))
        reference = len(tokenizer.encode("the", add_bos=True))
        first = {w: len(tokenizer.encode(w, add_bos=True)) - self.num_base_tokens for w in _WORDS}
        after = {w: len(tokenizer.encode(f"the {w}", add_bos=True)) - reference for w in _WORDS}
        self.first_costs = {w: c for w, c in first.items() if c >= 1}
        self.next_costs = {w: c for w, c in after.items() if c >= 1}
        if not self.first_costs or not self.next_costs:
            raise ValueError("the tokenizer gives no usable words to build prompts from")
        self._body_words = sorted(self.next_costs)
        self._max_cost = max(self.next_costs.values())
        self._fills = _fill_table(self.first_costs, self.next_costs, _TAIL_TOKENS + self._max_cost)

    def build(self, num_tokens: int, rng: np.random.Generator) -> str:
        """A text that encodes to ``num_tokens`` tokens (as near as the words allow)."""
        budget = num_tokens - self.num_base_tokens
        if budget <= 0:
            return ""
        body: list[str] = []
        picks = iter(rng.integers(0, len(self._body_words), size=budget + 1).tolist())
        while budget > _TAIL_TOKENS:
            word = self._body_words[next(picks)]
            body.append(word)
            budget -= self.next_costs[word]
        fill = self._fills.get(budget)
        while fill is None and body:  # no exact fill for this remainder: give words back
            budget += self.next_costs[body.pop()]
            fill = self._fills.get(budget)
        if fill is None:
            fill = self._fills[max(k for k in self._fills if k <= max(budget, 1))]
        first, tail = fill
        return " ".join([first, *body, *tail])

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_bos=True))


def _fill_table(
    first_costs: dict[str, int], next_costs: dict[str, int], limit: int
) -> dict[int, tuple[str, list[str]]]:
    """For each total up to ``limit``: one first word and the fewest following words whose
    costs sum to it (unreachable totals are absent)."""
    fewest: dict[int, list[str]] = {0: []}
    for total in range(1, limit + 1):
        options = [
            [*fewest[total - cost], word]
            for word, cost in sorted(next_costs.items())
            if total - cost in fewest
        ]
        if options:
            fewest[total] = min(options, key=len)
    fills: dict[int, tuple[str, list[str]]] = {}
    for total in range(1, limit + 1):
        options_f = [
            (word, fewest[total - cost])
            for word, cost in sorted(first_costs.items())
            if total - cost in fewest
        ]
        if options_f:
            fills[total] = min(options_f, key=lambda option: len(option[1]))
    return fills


def plan_requests(
    trace: Sequence[TraceRequest],
    builder: PromptBuilder,
    class_mix: Sequence[tuple[str, float]],
    max_model_len: int | None,
    seed: int,
) -> tuple[list[PlannedRequest], int]:
    """(requests, how many were shortened to fit ``max_model_len``). Lengths are fitted as the
    simulator fits them to its pool (output first, then prompt); classes drawn by ``class_mix``
    weights with ``seed``."""
    rng = np.random.default_rng(seed)
    names = [name for name, _ in class_mix]
    weights = np.array([weight for _, weight in class_mix], dtype=np.float64)
    classes: list[int] = []
    if names:
        classes = rng.choice(len(names), size=len(trace), p=weights / weights.sum()).tolist()
    planned: list[PlannedRequest] = []
    num_clipped = 0
    for index, request in enumerate(trace):
        input_len, output_len = request.input_len, request.output_len
        if max_model_len is not None:
            input_len = min(input_len, max_model_len - 1)
            output_len = max(1, min(output_len, max_model_len - input_len))
        num_clipped += (input_len, output_len) != (request.input_len, request.output_len)
        slo_class = names[classes[index]] if names else None
        prompt = builder.build(input_len, rng)
        planned.append(
            PlannedRequest(index, request.arrival_s, input_len, output_len, slo_class, prompt)
        )
    return planned, num_clipped
