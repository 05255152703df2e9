"""Tokenizers: Hugging Face ``tokenizer.json``, llama2.c ``tok*.bin``, and a byte tokenizer."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shared.model_source import model_display_name


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


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

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=True))


class ByteTokenizer:
    """UTF-8 bytes as tokens 3..258 (llama2.c's byte-fallback ids); BOS 1, EOS 2."""

    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    offset = 3

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [1, *ids] if add_bos else ids

    def decode(self, token_ids: list[int]) -> str:
        raw = bytes(t - self.offset for t in token_ids if self.offset <= t < self.offset + 256)
        return raw.decode("utf-8", errors="replace")


class Llama2cTokenizer:
    """llama2.c's BPE (format in stories260K/README.md): score-ordered pair merges over the
    UTF-8 characters of the text with a dummy-prefix space, byte fallback at ids 3..258."""

    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)

    def __init__(self, path: Path) -> None:
        data = path.read_bytes()
        (self.max_token_length,) = struct.unpack_from("<i", data, 0)
        offset = 4
        self.vocab: list[bytes] = []
        self.scores: list[float] = []
        while offset < len(data):
            score, length = struct.unpack_from("<fi", data, offset)
            offset += 8
            self.vocab.append(data[offset : offset + length])
            self.scores.append(score)
            offset += length
        self._ids = {piece: index for index, piece in enumerate(self.vocab)}

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids: list[int] = [1] if add_bos else []
        if not text:
            return ids
        tokens: list[int] = []
        for char in " " + text:
            piece = char.encode("utf-8")
            if piece in self._ids:
                tokens.append(self._ids[piece])
            else:
                tokens.extend(b + 3 for b in piece)
        while True:
            best_score, best_index, best_id = float("-inf"), -1, -1
            for index in range(len(tokens) - 1):
                merged = self.vocab[tokens[index]] + self.vocab[tokens[index + 1]]
                merged_id = self._ids.get(merged)
                if merged_id is not None and self.scores[merged_id] > best_score:
                    best_score, best_index, best_id = self.scores[merged_id], index, merged_id
            if best_index < 0:
                break
            tokens[best_index : best_index + 2] = [best_id]
        return ids + tokens

    def decode(self, token_ids: list[int]) -> str:
        out = bytearray()
        previous = 0
        for token in token_ids:
            if token in (1, 2):
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


# ---- what a gateway needs of a model: its tokenizer and chat template, no weights ----------


@dataclass(frozen=True, slots=True)
class TokenizerBundle:
    tokenizer: Tokenizer
    model_name: str
    chat_template: str | None = None  # jinja2 source from tokenizer_config.json, if any
    bos_token: str = ""
    eos_token: str = ""


class TokenizerNotFoundError(ValueError):
    """The model path holds no tokenizer we can load (a clear error, never a hub download)."""


def load_tokenizer_bundle(model: str, tokenizer_path: str | None = None) -> TokenizerBundle:
    """The tokenizer for ``model`` as ``superinfer generate`` names it: an HF checkpoint
    directory (tokenizer.json, tokenizer_config.json), a ``.gguf`` file (its metadata), a
    llama2.c ``.bin`` (``tok*.bin`` beside it, or ``tokenizer_path``), or ``tiny-random``."""
    if model == "tiny-random":
        return TokenizerBundle(ByteTokenizer(), model)
    path = Path(model)
    name = model_display_name(model)
    if not path.exists():
        raise TokenizerNotFoundError(f"model path {model!r} does not exist")
    if path.is_dir():
        return _hf_bundle(path, Path(tokenizer_path) if tokenizer_path else None, name)
    if path.suffix == ".gguf":  # the tokenizer is in the file's metadata
        from shared.gguf_tokenizer import load_gguf_bundle

        return load_gguf_bundle(Path(tokenizer_path) if tokenizer_path else path, name)
    source = Path(tokenizer_path) if tokenizer_path else None
    if source is None:
        source = next(iter(sorted(path.parent.glob("tok*.bin"))), None)
    if source is None or not source.is_file():
        raise TokenizerNotFoundError(f"no llama2.c tokenizer (tok*.bin) beside {model!r}")
    return TokenizerBundle(Llama2cTokenizer(source), name)


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
