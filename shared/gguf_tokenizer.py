"""The tokenizer and chat template a GGUF file describes in its metadata (llama.cpp's
``tokenizer.ggml.*`` keys), built as an in-memory ``tokenizers.Tokenizer``. Only metadata is
read (the reader memory-maps the file; no tensor is touched), so the gateway can use it.

``tokenizer.ggml.model`` "gpt2" is byte-level BPE, split as llama.cpp splits for
``tokenizer.ggml.pre``: the Llama-3 and Qwen2 regexes for their names, digits one by one and
then GPT-2's regex for "smollm" and its kin (transformers skips that digit step), GPT-2's regex
for "default", "gpt2" and any name not listed here (as transformers does). "llama" is
SentencePiece BPE: merges ranked by token score, byte fallback, "▁" for spaces."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.tokenizer_base import (
    HFTokenizer,
    TokenizerBundle,
    TokenizerNotFoundError,
    bytes_to_unicode,
)

if TYPE_CHECKING:
    from gguf import GGUFReader
    from tokenizers import Tokenizer as FastTokenizer

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with (llama.cpp's llama-vocab)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), _QWEN2_SPLIT),
}
# these isolate every digit before GPT-2's regex runs
DIGIT_SPLIT_PRE_TOKENIZERS = ("smollm", "starcoder", "refact", "command-r", "codeshell")


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader (metadata parsed, tensors memory-mapped); a clear error otherwise."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise TokenizerNotFoundError("reading a .gguf file needs the 'gguf' package") from exc
    try:
        return GGUFReader(path)
    except (ValueError, KeyError, IndexError, TypeError, OSError) as exc:
        raise TokenizerNotFoundError(f"{path} is not a readable GGUF file: {exc}") from exc


def metadata(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The value of metadata ``key`` (a str, number, bool or list), ``default`` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except ValueError as exc:  # a string that is not UTF-8
        raise TokenizerNotFoundError(f"GGUF metadata {key!r} cannot be read: {exc}") from exc


def load_gguf_bundle(path: Path, name: str) -> TokenizerBundle:
    """The gateway's view of a GGUF model: its tokenizer and chat template."""
    bundle = bundle_from_reader(open_gguf(path), name)
    if bundle is None:
        raise TokenizerNotFoundError(f"{path} has no tokenizer metadata (tokenizer.ggml.*)")
    return bundle


def bundle_from_reader(reader: GGUFReader, name: str) -> TokenizerBundle | None:
    """The tokenizer bundle the metadata describes; None when it has no tokenizer at all."""
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    if not tokens:
        return None
    fast = build_tokenizer(reader, tokens)
    bos_id = metadata(reader, "tokenizer.ggml.bos_token_id")
    eos_ids = eos_token_ids(reader)
    template = metadata(reader, "tokenizer.chat_template")
    return TokenizerBundle(
        HFTokenizer.from_tokenizer(fast, bos_id, eos_ids),
        name,
        template if isinstance(template, str) else None,
        _token_text(tokens, bos_id),
        _token_text(tokens, eos_ids[0] if eos_ids else None),
    )


def eos_token_ids(reader: GGUFReader) -> tuple[int, ...]:
    """End-of-sequence then end-of-turn ids (llama.cpp stops at either)."""
    found: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = metadata(reader, key)
        if isinstance(value, int) and value not in found:
            found.append(value)
    return tuple(found)


def _token_text(tokens: list[str], token_id: int | None) -> str:
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else ""


def build_tokenizer(reader: GGUFReader, tokens: list[str]) -> FastTokenizer:
    """The ``tokenizers.Tokenizer`` for ``tokenizer.ggml.model``, with special tokens added
    and BOS/EOS added as ``tokenizer.ggml.add_bos_token``/``add_eos_token`` say."""
    kind = metadata(reader, "tokenizer.ggml.model")
    token_types = metadata(reader, "tokenizer.ggml.token_type") or []
    if kind == "gpt2":
        fast = _byte_level_bpe(reader, tokens)
        alphabet = set(bytes_to_unicode().values())
        control = _of_type(tokens, token_types, TOKEN_TYPE_CONTROL)
        control = [t for t in control if set(t) <= alphabet]  # others are mislabels
        default_bos = False
    elif kind == "llama":
        fast = _sentencepiece_bpe(reader, tokens)
        control = _of_type(tokens, token_types, TOKEN_TYPE_CONTROL)
        default_bos = True
    else:
        raise TokenizerNotFoundError(
            f"GGUF tokenizer.ggml.model {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)})"
        )
    _add_special_tokens(fast, control, tokens, token_types)
    _set_post_processor(fast, reader, tokens, default_bos)
    return fast


def _add_special_tokens(
    fast: FastTokenizer, control: list[str], tokens: list[str], token_types: list[int]
) -> None:
    """Control tokens as special added tokens, user-defined ones (like ``<think>``) as plain
    added tokens: both are matched whole in the text, as llama.cpp does."""
    from tokenizers import AddedToken

    fast.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = fast.get_vocab()
    user_defined = _of_type(tokens, token_types, TOKEN_TYPE_USER_DEFINED)
    fast.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t in user_defined if t in vocab]
    )


def _of_type(tokens: list[str], token_types: list[int], wanted: int) -> list[str]:
    return [t for t, kind in zip(tokens, token_types, strict=False) if kind == wanted]


def _set_post_processor(
    fast: FastTokenizer, reader: GGUFReader, tokens: list[str], default_bos: bool
) -> None:
    from tokenizers import processors

    pieces: list[str] = ["$A"]
    special: list[tuple[str, int]] = []
    for flag, id_key, default, at_start in (
        ("add_bos_token", "bos_token_id", default_bos, True),
        ("add_eos_token", "eos_token_id", False, False),
    ):
        token_id = metadata(reader, f"tokenizer.ggml.{id_key}")
        if not metadata(reader, f"tokenizer.ggml.{flag}", default) or token_id is None:
            continue
        text = _token_text(tokens, token_id)
        pieces.insert(0 if at_start else len(pieces), text)
        special.append((text, token_id))
    fast.post_processor = processors.TemplateProcessing(
        single=" ".join(pieces), special_tokens=special
    )


def _byte_level_bpe(reader: GGUFReader, tokens: list[str]) -> FastTokenizer:
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as FastTokenizer

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merges = [_split_merge(merge) for merge in metadata(reader, "tokenizer.ggml.merges") or []]
    fast = FastTokenizer(models.BPE(vocab, merges, fuse_unk=False))
    pre = metadata(reader, "tokenizer.ggml.pre", "default")
    split = PRE_TOKENIZER_SPLITS.get(pre)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    steps: list[Any] = [byte_level]
    if split is not None:
        steps.insert(0, pre_tokenizers.Split(Regex(split), behavior="isolated"))
    elif pre in DIGIT_SPLIT_PRE_TOKENIZERS:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    fast.pre_tokenizer = pre_tokenizers.Sequence(steps)
    fast.decoder = decoders.ByteLevel()
    return fast


def _split_merge(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _sentencepiece_bpe(reader: GGUFReader, tokens: list[str]) -> FastTokenizer:
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(tokens)}
    merges = metadata(reader, "tokenizer.ggml.merges")
    if merges:
        pairs = [_split_merge(merge) for merge in merges]
    else:
        scores = metadata(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        pairs = _merges_from_scores(tokens, scores, vocab)
    unk = _token_text(tokens, metadata(reader, "tokenizer.ggml.unknown_token_id"))
    model = models.BPE(vocab, pairs, unk_token=unk or None, fuse_unk=True, byte_fallback=True)
    fast = FastTokenizer(model)
    prefix = bool(metadata(reader, "tokenizer.ggml.add_space_prefix", True))
    fast.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    fast.decoder = decoders.Sequence(steps)
    return fast


def _merges_from_scores(
    tokens: list[str], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """SentencePiece BPE as pair merges: every split of a token into two vocabulary pieces,
    best token score first (ties: longer left piece first), as transformers derives them."""
    ranked: list[tuple[str, str, float]] = []
    for token, score in zip(tokens, scores, strict=False):
        splits = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((left, right, score) for left, right in splits)
    ranked.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]
