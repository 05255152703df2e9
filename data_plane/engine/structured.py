"""Structured outputs with xgrammar: each request's grammar (a JSON schema, a regex, a choice
of strings or an EBNF grammar) becomes a matcher when the request arrives, and every step the
batch's allowed tokens are one bitmask applied to the logits before sampling.

xgrammar, not llguidance: ``bench/grammar_masks.py`` measured filling a row's mask at 2.8 us
(xgrammar) against 24.3 us (llguidance) at batch 64 on SmolLM2's 49,152-token vocabulary,
one 8.7x (docs/benchmarks.md); vLLM defaults to it too. The vocabulary comes from the served
tokenizer: a Hugging Face fast tokenizer through xgrammar's own reader, llama2.c's and the
byte tokenizer as the bytes each id decodes to. Compiled grammars are cached by (kind, spec)."""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from typing import Any

import torch

from data_plane.engine.request import RequestError
from data_plane.engine.sampling import SamplingRow
from shared.grammar import GrammarError, build_grammar, clean
from shared.sampling import StructuredOutput
from shared.tokenizer import ByteTokenizer, HFTokenizer, Llama2cTokenizer, Tokenizer

MAX_CACHED_GRAMMARS = 256


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

    def compile(self, structured: StructuredOutput) -> None:
        """Compile ``structured`` into the cache (off the serving loop: it can take 0.3 s)."""
        self._compiled(structured)

    def is_compiled(self, structured: StructuredOutput) -> bool:
        with self._lock:
            return (structured.kind, structured.spec) in self._cache

    def _compiled(self, structured: StructuredOutput) -> Any:
        key = (structured.kind, structured.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = self._get_compiler().compile_grammar(build_grammar(structured))
        except GrammarError as exc:
            raise RequestError(str(exc)) from exc
        except (RuntimeError, ValueError, TypeError) as exc:  # compiling for the vocabulary
            raise RequestError(f"the {structured.kind} structured output: {clean(exc)}") from exc
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = _tokenizer_info(self.tokenizer, self.vocab_size, self.stop_ids)
                # xgrammar's own cache has no bound by default (every distinct schema a
                # client sends, kept: ~200 KB each); ours above holds MAX_CACHED_GRAMMARS
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler


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


def ends_where_grammar_ends(
    allowed: torch.Tensor, matchers: list[Any], rows: list[SamplingRow]
) -> list[SamplingRow]:
    """``rows``, where a row's grammar now allows nothing but its stop tokens, without the
    ``min_tokens`` mask on them: the grammar's end wins. (Both masks left every logit at -inf
    and the sampler drew tokens the grammar refused: ``"yes"`` then ``"ectable"`` four times
    for a choice with ``min_tokens`` 5.)"""
    for i, (matcher, row) in enumerate(zip(matchers, rows, strict=True)):
        if matcher is None or not row.suppressed_ids:
            continue
        other = torch.isfinite(allowed[i])
        other[list(row.suppressed_ids)] = False
        if not bool(other.any()):
            rows[i] = dataclasses.replace(row, suppressed_ids=())
    return rows
