"""A structured output (JSON schema, regex, choice of strings, EBNF grammar) as an xgrammar
grammar, before any tokenizer: the gateway builds it to refuse one that does not compile with a
400 before a stream starts (vLLM's front end does the same), the worker compiles it for its
vocabulary. Both sides build it here, so they cannot disagree on what compiles."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from shared.sampling import StructuredOutput
from shared.schema_support import unenforced_keyword

# xgrammar's messages start "[03:42:01] /project/cpp/regex_converter.cc:94: ": not the client's
_SOURCE_PREFIX = re.compile(r"^(?:\[[\d:]+\]\s*)?\S+\.(?:cc|cpp|h|py):\d+:\s*")


class GrammarError(ValueError):
    """The structured output does not compile; the message says why, for the client."""


def build_grammar(structured: StructuredOutput) -> Any:
    """The ``xgrammar.Grammar``; GrammarError when it does not compile."""
    import xgrammar

    kind, spec = structured.kind, structured.spec
    try:
        if kind == "json":
            problem = unenforced_keyword(json.loads(spec))
            if problem is not None:
                raise GrammarError(f"the json structured output: {problem}")
            return xgrammar.Grammar.from_json_schema(spec, any_whitespace=False)
        if kind == "regex":
            return xgrammar.Grammar.from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            if not (
                isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)
            ):
                raise GrammarError("a choice is a non-empty list of strings")
            return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(map(_ebnf_string, choices)))
        return xgrammar.Grammar.from_ebnf(spec)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(f"the {kind} structured output: {clean(exc)}") from exc


@functools.lru_cache(maxsize=256)
def grammar_problem(structured: StructuredOutput) -> str | None:
    """Why ``structured`` cannot be served (None: it can): it does not compile, or it matches
    no string at all (``root ::= root root``: every token masked, the sampler drew what the
    grammar refused); the last 256 answers kept."""
    try:
        grammar = build_grammar(structured)
    except GrammarError as exc:
        return str(exc)
    if _matches_nothing(grammar):
        return f"the {structured.kind} structured output matches no string"
    return None


def _matches_nothing(grammar: Any) -> bool:
    """Whether no byte can start a string of ``grammar`` and the empty string is not one of
    them (compiled for a vocabulary of the 256 bytes and an end token: milliseconds)."""
    import xgrammar

    compiled = _byte_compiler().compile_grammar(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, 257)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return not bool(bitmask.any())


@functools.lru_cache(maxsize=1)
def _byte_compiler() -> Any:
    import xgrammar

    vocab = [bytes([value]) for value in range(256)] + [b"<end>"]
    info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, stop_token_ids=[256])
    return xgrammar.GrammarCompiler(info, cache_enabled=False)


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal (JSON's escapes are xgrammar's)."""
    return json.dumps(text, ensure_ascii=False)


def clean(exc: BaseException) -> str:
    """xgrammar's message for a client: its first line, without its timestamp and source."""
    text = str(exc).strip()
    message = text.splitlines()[0] if text else repr(exc)
    return _SOURCE_PREFIX.sub("", message)[:300]
