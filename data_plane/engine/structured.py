"""Structured outputs with xgrammar: each request's grammar (a JSON schema, a regex, a choice
of strings or an EBNF grammar) becomes a matcher when the request arrives, and every step the
batch's allowed tokens are one bitmask applied to the logits before sampling.

xgrammar, not llguidance: ``bench/grammar_masks.py`` measured filling a row's mask at 2.8 us
(xgrammar) against 24.3 us (llguidance) at batch 64 on SmolLM2's 49,152-token vocabulary,
one 8.7x (docs/benchmarks.md); vLLM defaults to it too. The vocabulary comes from the served
tokenizer: a Hugging Face fast tokenizer through xgrammar's own reader, llama2.c's and the
byte tokenizer as the bytes each id decodes to. Compiled grammars are cached by (kind, spec)."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from data_plane.engine.request import RequestError
from shared.sampling import StructuredOutput
from shared.tokenizer import ByteTokenizer, HFTokenizer, Llama2cTokenizer, Tokenizer

MAX_CACHED_GRAMMARS = 256


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal (JSON's escapes are xgrammar's)."""
    return json.dumps(text, ensure_ascii=False)


class Grammars:
    """Compiles a request's structured output into a matcher; RequestError (the client's 400)
    for one that does not compile. Built for the served tokenizer and the model's vocabulary
    (which may be padded past the tokenizer's)."""

    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, stop_ids: tuple[int, ...]
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, structured: StructuredOutput) -> Any:
        import xgrammar

        return xgrammar.GrammarMatcher(self._compiled(structured))

    def _compiled(self, structured: StructuredOutput) -> Any:
        key = (structured.kind, structured.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = self._compile(structured)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            message = _SOURCE_PREFIX.sub("", message)[:300]  # xgrammar's file:line, not ours
            raise RequestError(f"the {structured.kind} structured output: {message}") from exc
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, structured: StructuredOutput) -> Any:
        compiler = self._get_compiler()
        kind, spec = structured.kind, structured.spec
        if kind == "json":
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            if not (
                isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)
            ):
                raise ValueError("a choice is a non-empty list of strings")
            return compiler.compile_grammar("root ::= " + " | ".join(map(_ebnf_string, choices)))
        return compiler.compile_grammar(spec)

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = _tokenizer_info(self.tokenizer, self.vocab_size, self.stop_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
            return self._compiler


_SOURCE_PREFIX = re.compile(r"^\S+\.(?:cc|cpp|h|py):\d+:\s*")


def _tokenizer_info(tokenizer: Tokenizer | None, vocab_size: int, stop_ids: list[int]) -> Any:
    import xgrammar

    if isinstance(tokenizer, HFTokenizer):
        import transformers

        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.fast)
        return xgrammar.TokenizerInfo.from_huggingface(
            fast, vocab_size=vocab_size, stop_token_ids=stop_ids
        )
    if isinstance(tokenizer, ByteTokenizer | Llama2cTokenizer):
        return xgrammar.TokenizerInfo(
            tokenizer.token_bytes(vocab_size),
            xgrammar.VocabType.RAW,
            vocab_size=vocab_size,
            stop_token_ids=stop_ids,
        )
    raise RequestError("structured outputs need the model's tokenizer; this worker has none")


def mask_logits(logits: torch.Tensor, matchers: list[Any]) -> torch.Tensor:
    """``logits`` with each row's disallowed tokens at -inf, for the rows with a matcher (a
    copy; the raw logits stay for log-probabilities). One bitmask for the batch, filled on
    the host, applied on the logits' device."""
    rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return logits
    import xgrammar

    vocab = logits.shape[-1]
    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab)
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    masked = logits.clone()
    xgrammar.apply_token_bitmask_inplace(masked, bitmask.to(logits.device), indices=rows)
    return masked
