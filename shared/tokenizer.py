"""Tokenizers: Hugging Face ``tokenizer.json``, llama2.c ``tok*.bin``, and a byte tokenizer."""

from __future__ import annotations

import heapq
import json
import struct
from pathlib import Path
from typing import Any

from shared.gguf_tokenizer import load_gguf_bundle
from shared.model_source import model_display_name
from shared.tokenizer_base import HFTokenizer, Tokenizer, TokenizerBundle, TokenizerNotFoundError

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Llama2cTokenizer",
    "Tokenizer",
    "TokenizerBundle",
    "TokenizerNotFoundError",
    "load_tokenizer_bundle",
]


class ByteTokenizer:
    """UTF-8 bytes as tokens 3..258 (llama2.c's byte-fallback ids); BOS 1, EOS 2."""

    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    offset = 3

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [1, *ids] if add_bos else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        raw = bytearray()
        for t in token_ids:
            if self.offset <= t < self.offset + 256:
                raw.append(t - self.offset)
            elif not skip_special_tokens:
                raw += self.token_piece(t).encode()
        return raw.decode("utf-8", errors="replace")

    def token_piece(self, token_id: int) -> str:
        """``<0xNN>`` for a byte (llama2.c's spelling), ``<s>`` / ``</s>`` for BOS / EOS."""
        if self.offset <= token_id < self.offset + 256:
            return f"<0x{token_id - self.offset:02X}>"
        return {0: "<unk>", 1: "<s>", 2: "</s>"}[token_id]

    def token_raw_bytes(self, token_id: int) -> bytes:
        if self.offset <= token_id < self.offset + 256:
            return bytes([token_id - self.offset])
        if token_id in (0, 1, 2):
            return self.token_piece(token_id).encode()
        raise ValueError(f"{token_id} is not in the vocabulary")

    @property
    def vocab_size(self) -> int:
        return self.offset + 256

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        """Each id's bytes in decoded text (b"" for ids that decode to nothing)."""
        return [
            bytes([t - self.offset]) if self.offset <= t < self.offset + 256 else b""
            for t in range(vocab_size)
        ]


_MAX_CACHED_PAIRS = 1 << 16  # (left, right) -> merged token, per tokenizer: a few MB at most


MIN_LLAMA2C_VOCAB = 259  # <unk>, <s>, </s> and the 256 byte pieces


class Llama2cTokenizer:
    """llama2.c's BPE (format in stories260K/README.md): score-ordered pair merges over the
    UTF-8 characters of the text with a dummy-prefix space, byte fallback at ids 3..258."""

    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)

    def __init__(self, path: Path) -> None:
        data = path.read_bytes()
        self.vocab: list[bytes] = []
        self.scores: list[float] = []
        try:
            (self.max_token_length,) = struct.unpack_from("<i", data, 0)
            offset = 4
            while offset < len(data):
                score, length = struct.unpack_from("<fi", data, offset)
                offset += 8
                if length < 0 or offset + length > len(data):
                    raise struct.error(f"a {length}-byte piece at byte {offset}")
                self.vocab.append(data[offset : offset + length])
                self.scores.append(score)
                offset += length
        except struct.error as exc:
            message = f"{str(path)!r} is not a llama2.c tokenizer: {exc}"
            raise TokenizerNotFoundError(message) from exc
        if len(self.vocab) < MIN_LLAMA2C_VOCAB:  # 3 specials and 256 byte pieces
            raise TokenizerNotFoundError(
                f"{str(path)!r} is not a llama2.c tokenizer: {len(self.vocab)} pieces"
            )
        self._ids = {piece: index for index, piece in enumerate(self.vocab)}
        # Merge order: rank 0 is the best score, equal scores share a rank; a token scored
        # NaN or -inf is never a merge's result (the reference's "score > best" never holds).
        usable = sorted({s for s in self.scores if s > float("-inf")}, reverse=True)
        by_score = {score: rank for rank, score in enumerate(usable)}
        self._rank = [by_score.get(score, -1) for score in self.scores]
        self._pairs: dict[int, int] = {}

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """llama2.c's ``encode``: the pair whose merge scores highest, the leftmost of equals,
        merges first until none is in the vocabulary. A heap of candidate merges over a linked
        list does that in O(n log n) (the reference rescans every pair per merge: O(n^2)).
        UnicodeEncodeError (a ValueError) for text that is not valid Unicode."""
        ids: list[int] = [1] if add_bos else []
        if not text:
            return ids
        return ids + self._merge(self._symbols(" " + text))

    def _symbols(self, text: str) -> list[int]:
        """One token per character, or its UTF-8 bytes (ids 3..258) when it has none."""
        tokens: list[int] = []
        for char in text:
            piece = char.encode("utf-8")
            known = self._ids.get(piece)
            if known is not None:
                tokens.append(known)
            else:
                tokens.extend(b + 3 for b in piece)
        return tokens

    def _pair(self, left: int, right: int) -> int:
        """The token that merges ``left`` and ``right`` (-1: none), cached by pair."""
        key = left * len(self.vocab) + right
        merged = self._pairs.get(key)
        if merged is None:
            merged = self._ids.get(self.vocab[left] + self.vocab[right], -1)
            merged = merged if merged >= 0 and self._rank[merged] >= 0 else -1
            if len(self._pairs) < _MAX_CACHED_PAIRS:
                self._pairs[key] = merged
        return merged

    def _merge(self, tokens: list[int]) -> list[int]:
        """Merge in place. ``tokens[i]`` is the token that starts at symbol i (-1 once merged
        into its left neighbour), ``after``/``before`` link the live positions (-1: none). A
        heap entry ``rank * size + i`` stands for "the pair at i merges into a token of that
        score rank" (rank 0: the best score; equal scores, equal ranks); popping the smallest
        is the reference's choice, as i is monotone in list order. An entry whose position no
        longer holds a pair of its rank is stale; every live pair has an entry of its own."""
        size, rank = len(tokens), self._rank
        after = [*range(1, size), -1]
        before = list(range(-1, size - 1))
        heap = []
        for i in range(size - 1):
            merged = self._pair(tokens[i], tokens[i + 1])
            if merged >= 0:
                heap.append(rank[merged] * size + i)
        heapq.heapify(heap)
        while heap:
            entry_rank, i = divmod(heapq.heappop(heap), size)
            j = after[i]
            if tokens[i] < 0 or j < 0:
                continue
            merged = self._pair(tokens[i], tokens[j])
            if merged < 0 or rank[merged] != entry_rank:
                continue  # stale: i or its neighbour has merged since
            tokens[i], tokens[j] = merged, -1
            after[i] = after[j]
            if after[j] >= 0:
                before[after[j]] = i
            for left, right in ((before[i], i), (i, after[i])):
                if left >= 0 and right >= 0:
                    pair = self._pair(tokens[left], tokens[right])
                    if pair >= 0:
                        heapq.heappush(heap, rank[pair] * size + left)
        return [t for t in tokens if t >= 0]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def token_piece(self, token_id: int) -> str:
        """The vocabulary's piece (bytes as written, spaces included; BOS and EOS as
        ``<s>`` and ``</s>``, which the file writes with newlines around them)."""
        return self.vocab[token_id].decode("utf-8", "backslashreplace").strip("\n")

    def token_raw_bytes(self, token_id: int) -> bytes:
        if token_id in (0, 1, 2):
            return self.token_piece(token_id).encode()
        if not 0 <= token_id < len(self.vocab):
            raise ValueError(f"{token_id} is not in the vocabulary")
        piece = self.vocab[token_id]
        if piece.startswith(b"<0x") and piece.endswith(b">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])
        return piece

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        previous = 0
        for token in token_ids:
            if token in (1, 2):
                if not skip_special_tokens:
                    out += self.token_piece(token).encode()
                previous = token
                continue
            piece = self.vocab[token]
            if previous == 1 and piece.startswith(b" "):
                piece = piece[1:]
            if piece.startswith(b"<0x") and piece.endswith(b">") and len(piece) == 6:
                piece = bytes([int(piece[3:5], 16)])
            out += piece
            previous = token
        return out.decode("utf-8", errors="replace")

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        """Each id's bytes in decoded text (b"" for the special ids 0-2 and past the vocabulary;
        a leading space stays: text after BOS loses it only at the very start)."""
        out = []
        for token in range(vocab_size):
            piece = self.vocab[token] if 2 < token < len(self.vocab) else b""
            if piece.startswith(b"<0x") and piece.endswith(b">") and len(piece) == 6:
                piece = bytes([int(piece[3:5], 16)])
            out.append(piece)
        return out


# ---- what a gateway needs of a model: its tokenizer and chat template, no weights ----------


def load_tokenizer_bundle(model: str, tokenizer_path: str | None = None) -> TokenizerBundle:
    """The tokenizer for ``model`` as ``superinfer generate`` names it: an HF checkpoint
    directory (tokenizer.json, tokenizer_config.json), a ``.gguf`` file (its metadata), a
    llama2.c ``.bin`` (``tok*.bin`` beside it, or ``tokenizer_path``), or ``tiny-random``."""
    if model == "tiny-random":
        if tokenizer_path:
            raise TokenizerNotFoundError("tiny-random has its own byte tokenizer: no --tokenizer")
        return TokenizerBundle(ByteTokenizer(), model)
    path = Path(model)
    name = model_display_name(model)
    if not path.exists():
        raise TokenizerNotFoundError(f"model path {model!r} does not exist")
    if path.is_dir():
        return _hf_bundle(path, Path(tokenizer_path) if tokenizer_path else None, name)
    if tokenizer_path:
        return tokenizer_bundle_at(Path(tokenizer_path), name)
    if path.suffix == ".gguf":  # the tokenizer is in the file's metadata
        return load_gguf_bundle(path, name)
    source = next(iter(sorted(path.parent.glob("tok*.bin"))), None)
    if source is None or not source.is_file():
        raise TokenizerNotFoundError(f"no llama2.c tokenizer (tok*.bin) beside {model!r}")
    return TokenizerBundle(Llama2cTokenizer(source), name)


def tokenizer_bundle_at(path: Path, name: str) -> TokenizerBundle:
    """``--tokenizer`` for a single-file model (GGUF, llama2.c), as vLLM takes it whatever the
    model's format: an HF tokenizer directory or its ``tokenizer.json`` (with the directory's
    chat template and special tokens), a ``.gguf`` file (its metadata) or a llama2.c
    ``tok*.bin``. The worker reads the same path the same way."""
    if not path.exists():
        raise TokenizerNotFoundError(f"tokenizer path {str(path)!r} does not exist")
    if path.suffix == ".gguf":
        return load_gguf_bundle(path, name)
    if path.is_dir() or path.suffix == ".json":
        return _hf_bundle(path if path.is_dir() else path.parent, path, name)
    return TokenizerBundle(Llama2cTokenizer(path), name)


def _hf_bundle(directory: Path, tokenizer_path: Path | None, name: str) -> TokenizerBundle:
    tokenizer_file = tokenizer_path or directory / "tokenizer.json"
    if tokenizer_file.is_dir():
        tokenizer_file = tokenizer_file / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TokenizerNotFoundError(f"no tokenizer.json in {str(directory)!r}")
    config = _read_json(directory / "config.json")
    generation = _read_json(directory / "generation_config.json")
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    tok_config = _read_json(directory / "tokenizer_config.json")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = directory / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    return TokenizerBundle(
        HFTokenizer(tokenizer_file, config.get("bos_token_id"), eos_ids),
        name,
        template if isinstance(template, str) else None,
        _token_text(tok_config.get("bos_token")),
        _token_text(tok_config.get("eos_token")),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""
