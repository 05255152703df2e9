"""Log-probabilities in OpenAI's and vLLM's response shapes, from the worker's columns
(:class:`shared.logprobs.TokenLogprobs`).

- completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, each top map
  holding the position's own token and the N most likely (the prompt's first token, with
  ``echo``, has ``null`` for its log-probability and top);
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``;
- vLLM's ``prompt_logprobs``: ``[null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]``.

A token's text is the tokenizer's decoding of that token alone. JSON has no infinity: a
log-probability of -inf is written as -9999.0, as vLLM does."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.logprobs import TokenLogprobs

Decode = Callable[[int], str]


@dataclass(frozen=True, slots=True)
class TokenNames:
    """How chat log-probabilities name a token: its text and its own bytes (a piece of a
    multi-byte character has bytes that do not decode alone)."""

    text: Decode
    raw: Callable[[int], bytes]


FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


@dataclass(slots=True)
class CompletionLogprobs:
    """A completion choice's ``logprobs`` object, built position by position (text offsets
    run on from the last one, so streamed chunks continue where the previous ended)."""

    decode: Decode
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    next_offset: int = 0

    def add_first(self, token_id: int) -> None:
        """A position with no log-probability (the prompt's first token)."""
        self._add(token_id, None, None)

    def add(
        self,
        token_ids: list[int] | tuple[int, ...],
        values: TokenLogprobs,
        num_top: int | None = None,
    ) -> None:
        """Positions with their token's log-probability and a top map of that token first,
        then the N most likely (up to N + 1 entries, as OpenAI's and vLLM's completions;
        ``num_top`` caps N below what ``values`` carries: echoed prompt positions computed
        for a larger ``prompt_logprobs``)."""
        for i, token_id in enumerate(token_ids):
            logprob = _finite(values.logprobs[i])
            top = {self.decode(token_id): logprob}
            pairs = zip(values.top_ids[i], values.top_logprobs[i], strict=True)
            for t, v in itertools.islice(pairs, num_top):
                top.setdefault(self.decode(t), _finite(v))
            self._add(token_id, logprob, top)

    def _add(self, token_id: int, logprob: float | None, top: dict[str, float] | None) -> None:
        text = self.decode(token_id)
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.next_offset)
        self.next_offset += len(text)

    def take(self) -> dict[str, Any]:
        """The object so far; the lists start anew (the offsets run on)."""
        body = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return body


def _entry(names: TokenNames, token_id: int, logprob: float) -> dict[str, Any]:
    raw = list(names.raw(token_id))
    return {"token": names.text(token_id), "logprob": _finite(logprob), "bytes": raw}


def chat_content(
    token_ids: list[int] | tuple[int, ...], values: TokenLogprobs, names: TokenNames
) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries for ``token_ids`` (``bytes``: the token's own, as
    OpenAI's: joined over the tokens they are the text's UTF-8)."""
    content = []
    for i, token_id in enumerate(token_ids):
        entry = _entry(names, token_id, values.logprobs[i])
        pairs = zip(values.top_ids[i], values.top_logprobs[i], strict=True)
        entry["top_logprobs"] = [_entry(names, t, v) for t, v in pairs]
        content.append(entry)
    return content


def vllm_prompt_logprobs(
    prompt_ids: list[int], values: TokenLogprobs, decode: Decode
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: null for the first token, then per token a map from token
    id (as a string) to its log-probability, rank and text: the prompt's token and the top."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for i, token_id in enumerate(prompt_ids[1:]):
        position = {
            str(token_id): {
                "logprob": _finite(values.logprobs[i]),
                "rank": values.ranks[i],
                "decoded_token": decode(token_id),
            }
        }
        for rank, (t, v) in enumerate(
            zip(values.top_ids[i], values.top_logprobs[i], strict=True), 1
        ):
            position.setdefault(
                str(t), {"logprob": _finite(v), "rank": rank, "decoded_token": decode(t)}
            )
        out.append(position)
    return out
