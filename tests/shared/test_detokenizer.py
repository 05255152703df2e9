"""Incremental detokenizing checked against decoding the whole sequence at once (the
tokenizer's own answer), with multi-byte characters split over tokens and stop strings split
over deltas."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.detokenizer import IncrementalDetokenizer
from shared.tokenizer import ByteTokenizer, Llama2cTokenizer


def _stream(detok: IncrementalDetokenizer, token_ids: list[int], step: int) -> list[str]:
    deltas = [detok.add(token_ids[i : i + step]) for i in range(0, len(token_ids), step)]
    return [*deltas, detok.flush()]


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=1, max_size=40), step=st.integers(1, 4))
def test_bytes_never_split_a_character(text: str, step: int) -> None:
    tok = ByteTokenizer()
    prompt = tok.encode("ab")
    output = tok.encode(text, add_bos=False)
    deltas = _stream(IncrementalDetokenizer(tok, prompt), output, step)
    assert "".join(deltas) == text
    if "\ufffd" not in text:  # no half character is ever released
        assert all("\ufffd" not in d for d in deltas)


@pytest.fixture(scope="module")
def llama2c(stories_path: Path) -> Llama2cTokenizer:
    return Llama2cTokenizer(stories_path.parent / "tok512.bin")


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.text(alphabet="abc xyzé", max_size=12),
    output=st.text(alphabet="Once upon a time, élan 🙂", min_size=1, max_size=40),
)
def test_llama2c_deltas_join_to_the_full_decode(
    llama2c: Llama2cTokenizer, prompt: str, output: str
) -> None:
    prompt_ids = llama2c.encode(prompt)
    full_ids = llama2c.encode(prompt + output)
    if full_ids[: len(prompt_ids)] != prompt_ids:
        return  # the merge crossed the boundary: not a continuation of this prompt
    output_ids = full_ids[len(prompt_ids) :]
    expected = llama2c.decode(full_ids)[len(llama2c.decode(prompt_ids)) :]
    deltas = _stream(IncrementalDetokenizer(llama2c, prompt_ids), output_ids, 1)
    assert "".join(deltas) == expected


def test_stop_string_split_over_tokens_is_cut_and_never_streamed() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [1], stop=["STOP", "never"])
    released = [detok.add([t]) for t in tok.encode("hello STOP world", add_bos=False)]
    released.append(detok.flush())
    assert "".join(released) == "hello "
    assert detok.stopped
    assert not any("S" in r for r in released)


def test_partial_stop_prefix_is_released_when_it_does_not_complete() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [1], stop=["STOP"])
    deltas = [detok.add([t]) for t in tok.encode("a STO b", add_bos=False)]
    assert "".join(deltas) + detok.flush() == "a STO b"
    assert not detok.stopped


def _vllm_stop(text: str, stops: list[str], min_tokens: int) -> str:
    """vLLM's rule for one-character tokens, written out: at each token past ``min_tokens``,
    a stop string counts if it ends in that token's text; the first token with one ends the
    text before the earliest such string."""
    for end in range(min_tokens + 1, len(text) + 1):
        starts = [end - len(s) for s in stops if s and text[:end].endswith(s)]
        if starts:
            return text[: min(starts)]
    return text


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abX", min_size=1, max_size=16),
    stops=st.lists(st.text(alphabet="abX", min_size=1, max_size=3), min_size=1, max_size=2),
    min_tokens=st.integers(0, 6),
    step=st.integers(1, 3),
)
def test_stop_strings_count_only_when_they_end_past_min_tokens(
    text: str, stops: list[str], min_tokens: int, step: int
) -> None:
    """A stop string lying wholly in the first ``min_tokens`` tokens' text, or ending in the
    ``min_tokens``-th, never stops the request (vLLM's check starts after that token)."""
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("ab"), stops, min_tokens=min_tokens)
    deltas = _stream(detok, tok.encode(text, add_bos=False), step)
    assert "".join(deltas) == _vllm_stop(text, stops, min_tokens)
