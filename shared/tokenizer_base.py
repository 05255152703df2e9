"""What every tokenizer loader builds on: the :class:`Tokenizer` protocol, the wrapper of a
Hugging Face fast tokenizer (from ``tokenizer.json`` or built from GGUF metadata), the
gateway's :class:`TokenizerBundle` and the error when a model has no tokenizer. Both
``tokenizer`` and ``gguf_tokenizer`` import these, so neither imports the other for them."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shared.errors import ConfigError

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``; special tokens (BOS, ``<|im_start|>``...) left out, or
        written as their text with ``skip_special_tokens`` False (Hugging Face's default)."""
        ...

    def token_piece(self, token_id: int) -> str:
        """The token as the vocabulary writes it (Hugging Face's ``convert_ids_to_tokens``:
        ``"Ġhello"``, ``"<|im_start|>"``), as vLLM's ``/tokenize`` returns ``token_strs``."""
        ...

    def token_raw_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (OpenAI's log-probability ``bytes``): a piece of a multi-byte
        character is that piece's bytes, not U+FFFD; a special token is its text. ValueError
        for an id the tokenizer does not know."""
        ...

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer knows: 0 .. vocab_size - 1 (a model's may be padded past it)."""
        ...


class HFTokenizer:
    """A ``tokenizers`` fast tokenizer loaded from a local ``tokenizer.json``."""

    def __init__(self, path: Path, bos_token_id: int | None, eos_token_ids: tuple[int, ...]):
        from tokenizers import Tokenizer as FastTokenizer

        self._tok = FastTokenizer.from_file(str(path))
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_tokenizer(
        cls, fast: Any, bos_token_id: int | None, eos_token_ids: tuple[int, ...]
    ) -> HFTokenizer:
        """Wrap an in-memory ``tokenizers.Tokenizer`` (one built from GGUF metadata)."""
        tokenizer = cls.__new__(cls)
        tokenizer._tok = fast
        tokenizer.bos_token_id = bos_token_id
        tokenizer.eos_token_ids = eos_token_ids
        return tokenizer

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """The tokenizer's own special tokens (its post-processor: BOS for Llama and Mistral,
        none for Qwen2), as Hugging Face's tokenizers and vLLM add them; none when
        ``add_bos`` is False (chat templates write their own)."""
        return list(self._tok.encode(text, add_special_tokens=add_bos).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_piece(self, token_id: int) -> str:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"{token_id} is not in the vocabulary")
        return str(piece)

    def token_raw_bytes(self, token_id: int) -> bytes:
        piece = self.token_piece(token_id)
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_level:
            return bytes(_unicode_to_byte()[c] for c in piece)
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte[1], 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's space

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the decoder maps GPT-2's byte alphabet back to bytes (GPT-2, Llama 3, Qwen,
        SmolLM), else SentencePiece-style pieces."""
        decoder = self._tok.decoder
        return decoder is not None and '"ByteLevel"' in json.dumps(
            json.loads(decoder.__getstate__())
        )

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def fast(self) -> Any:
        """The ``tokenizers.Tokenizer`` itself (structured outputs build their vocabulary from
        it)."""
        return self._tok


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells tokens with it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    return {char: byte for byte, char in bytes_to_unicode().items()}


@dataclass(frozen=True, slots=True)
class TokenizerBundle:
    tokenizer: Tokenizer
    model_name: str
    chat_template: str | None = None  # jinja2 source from tokenizer_config.json, if any
    bos_token: str = ""
    eos_token: str = ""


class TokenizerNotFoundError(ConfigError):
    """The model path holds no tokenizer we can load (a clear error, never a hub download)."""
