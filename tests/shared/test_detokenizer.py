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
