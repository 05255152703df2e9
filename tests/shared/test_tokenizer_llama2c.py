"""The llama2.c tokenizer's O(n log n) merge loop gives exactly the tokens of the reference
O(n^2) loop (a copy of it is kept below) on random and real text, ties and unusable scores
included, and the kit's stories260K reference; a long prompt no longer takes quadratic time."""

from __future__ import annotations

import math
import random
import struct
import time
from pathlib import Path

import pytest

from shared.tokenizer import Llama2cTokenizer, TokenizerNotFoundError
from tests.conftest import STORIES_DIR, STORIES_REFERENCE_TEXT, STORIES_REFERENCE_TOKENS

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    'park. One day, she saw a big, red ball. "Can I play?" she asked.\nThe end. '
)
ALPHABET = "abcdeehilnorst    ,.\n'\"é中😀\t"


def reference_encode(tok: Llama2cTokenizer, text: str, add_bos: bool = True) -> list[int]:
    """The merge loop as it was (and as llama2.c's ``encode`` is): rescan every pair, merge
    the best-scored (the leftmost of equals), repeat."""
    ids: list[int] = [1] if add_bos else []
    if not text:
        return ids
    tokens: list[int] = []
    for char in " " + text:
        piece = char.encode("utf-8")
        if piece in tok._ids:
            tokens.append(tok._ids[piece])
        else:
            tokens.extend(b + 3 for b in piece)
    while True:
        best_score, best_index, best_id = float("-inf"), -1, -1
        for index in range(len(tokens) - 1):
            merged = tok.vocab[tokens[index]] + tok.vocab[tokens[index + 1]]
            merged_id = tok._ids.get(merged)
            if merged_id is not None and tok.scores[merged_id] > best_score:
                best_score, best_index, best_id = tok.scores[merged_id], index, merged_id
        if best_index < 0:
            break
        tokens[best_index : best_index + 2] = [best_id]
    return ids + tokens


def _write_vocab(path: Path, pieces: list[tuple[bytes, float]]) -> Path:
    """A llama2.c tokenizer file: <unk>, BOS, EOS, the 256 byte tokens, then ``pieces``."""
    specials = [(b"<unk>", 0.0), (b"\n<s>\n", 0.0), (b"\n</s>\n", 0.0)]
    byte_tokens = [(f"<0x{b:02X}>".encode(), 0.0) for b in range(256)]
    entries = specials + byte_tokens + pieces
    data = struct.pack("<i", max(len(p) for p, _ in entries))
    for piece, score in entries:
        data += struct.pack("<fi", score, len(piece)) + piece
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Llama2cTokenizer:
    """Small pieces with many equal scores (ties decide by position), a NaN and a -inf score
    (never merge results), and pieces reachable by more than one split."""
    chars = ["a", "b", "c", " ", "é", "中"]
    pieces = [(c.encode(), -100.0) for c in chars]
    merges = ["ab", "ba", "bc", "ca", " a", "abc", "cab", "aa", "bb", "abab", "a b", " ab", "é中"]
    scores = [-1.0, -1.0, -1.0, -2.0, -1.0, -2.0, -2.0, -3.0, -1.0, -0.5, -1.0, -2.0, -1.0]
    pieces += [(m.encode(), s) for m, s in zip(merges, scores, strict=True)]
    pieces += [(b"cc", math.nan), (b"ac", float("-inf"))]
    path = tmp_path_factory.mktemp("llama2c") / "tied.bin"
    return Llama2cTokenizer(_write_vocab(path, pieces))


@pytest.fixture(scope="module")
def stories_tok() -> Llama2cTokenizer:
    path = STORIES_DIR / "tok512.bin"
    if not path.exists():
        pytest.skip("../shared/models/stories260K is not present")
    return Llama2cTokenizer(path)


def _random_texts(alphabet: str, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(alphabet, k=rng.randint(0, 120))) for _ in range(count)]


def test_ties_and_unusable_scores_match_the_reference(tied: Llama2cTokenizer) -> None:
    for text in _random_texts("abc é中x", 400, seed=1):
        for add_bos in (True, False):
            assert tied.encode(text, add_bos) == reference_encode(tied, text, add_bos), text


def test_random_and_real_text_match_the_reference(stories_tok: Llama2cTokenizer) -> None:
    texts = [*_random_texts(ALPHABET, 150, seed=2), STORY, STORY * 12, STORY.upper() * 3]
    for text in texts:
        assert stories_tok.encode(text) == reference_encode(stories_tok, text), text
    assert stories_tok.encode("") == [1] and stories_tok.encode("", add_bos=False) == []


def test_the_kit_reference_text_encodes_to_its_tokens(stories_tok: Llama2cTokenizer) -> None:
    """The kit's reference generation (stories260K/README.md) encodes back to its tokens."""
    ids = stories_tok.encode(STORIES_REFERENCE_TEXT)
    assert ids[: 1 + len(STORIES_REFERENCE_TOKENS)] == [1, *STORIES_REFERENCE_TOKENS]
    assert stories_tok.decode(ids) == STORIES_REFERENCE_TEXT


def test_a_long_prompt_is_not_quadratic(stories_tok: Llama2cTokenizer) -> None:
    """200k characters: well under a second here (the reference took 6 s for 10k and did not
    finish 40k in 85 s); the bound leaves room for a loaded machine."""
    text = (STORY * (200_000 // len(STORY) + 1))[:200_000]
    started = time.perf_counter()
    ids = stories_tok.encode(text)
    assert time.perf_counter() - started < 10.0
    assert stories_tok.decode(ids) == text


def test_a_lone_surrogate_is_a_value_error(stories_tok: Llama2cTokenizer) -> None:
    with pytest.raises(ValueError):
        stories_tok.encode("a\ud800b")


@pytest.mark.parametrize(
    "content",
    [
        b"not a tokenizer at all, just text bytes\n",  # a stray file given as --tokenizer
        struct.pack("<i", 8),  # a header and no piece
        struct.pack("<ifi", 8, 0.0, 3) + b"ab",  # a piece cut short
    ],
)
def test_a_file_that_is_no_llama2c_tokenizer_is_refused(content: bytes, tmp_path: Path) -> None:
    """It loaded, and every request then failed with an IndexError in encode."""
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    with pytest.raises(TokenizerNotFoundError, match=r"not a llama2\.c tokenizer"):
        Llama2cTokenizer(path)
