"""Incremental, UTF-8-safe detokenizing with stop strings, one request at a time: the one
detokenizer, used by the gateway (serving) and the engine offline (``superinfer generate``).

Text is decoded over a sliding window that starts a few tokens back (vLLM's prefix/read offset
scheme), so a token's leading space and multi-token UTF-8 characters come out right, and a
delta is released only once it no longer ends in a partial character. Stop strings end the text
before them; a tail that may be the start of a stop string is held back until it resolves.
"""

from __future__ import annotations

from shared.tokenizer import Tokenizer

_CONTEXT_TOKENS = 6  # prompt tokens kept as decoding context


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        *,
        min_tokens: int = 0,
        include_stop_str: bool = False,
    ) -> None:
        """``min_tokens``: a stop string counts only if it ends in the text of a token after
        the first ``min_tokens`` (vLLM's rule); ``include_stop_str``: the text ends after the
        stop string, not before it."""
        self._tokenizer = tokenizer
        self._min_tokens = min_tokens
        self._include_stop_str = include_stop_str
        self._num_tokens = 0  # output tokens added
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = [s for s in (stop or []) if s]
        self._hold_chars = max((len(s) for s in self._stop), default=1) - 1
        self._raw = ""  # decoded output text (cut at a stop string once one is seen)
        self._num_emitted = 0  # characters of _raw already released
        self._stop_after = 0  # a stop string must end past this many characters (min_tokens)
        self.stopped = False  # a stop string was found: the request is over
        self.stop_string: str | None = None  # the one found (vLLM's stop_reason)

    @property
    def text(self) -> str:
        return self._raw[: self._num_emitted]

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text released by them (possibly empty)."""
        for token in token_ids:
            if self.stopped:
                break
            self._ids.append(token)
            self._num_tokens += 1
            self._raw += self._decode_delta()
            if self._num_tokens <= self._min_tokens:
                self._stop_after = len(self._raw)
            else:
                self._check_stop()
        end = len(self._raw) if self.stopped else len(self._raw) - self._hold_chars
        return self._release(end)

    def flush(self) -> str:
        """At the end of the request: release everything held back, including text still
        ending in U+FFFD (a real one, or a character the output ended in the middle of: as
        decoding the whole sequence gives it)."""
        if not self.stopped and self._read_offset < len(self._ids):
            prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._tokenizer.decode(self._ids[self._prefix_offset :])
            if len(new_text) > len(prefix_text):
                self._raw += new_text[len(prefix_text) :]
                self._read_offset = len(self._ids)
                self._check_stop()
        return self._release(len(self._raw))

    def _decode_delta(self) -> str:
        window = self._ids[self._prefix_offset :]
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._tokenizer.decode(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing printable yet (e.g. half of a UTF-8 character)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def _check_stop(self) -> None:
        if not self._stop or self._num_tokens <= self._min_tokens:
            return
        start = max(0, self._num_emitted - self._hold_chars)
        hits = [
            (i, len(s), s)
            for s in self._stop
            if (i := self._raw.find(s, max(start, self._stop_after - len(s) + 1))) >= 0
        ]
        if hits:
            index, length, self.stop_string = min(hits)
            self._raw = self._raw[: index + length if self._include_stop_str else index]
            self.stopped = True

    def _release(self, end: int) -> str:
        if end <= self._num_emitted:
            return ""
        delta = self._raw[self._num_emitted : end]
        self._num_emitted = end
        return delta
