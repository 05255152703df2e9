"""bench/heldout_trace.py: the held-out trace it writes loads as a real-arrival trace, follows
the mix asked for, and is the same for the same seed (its judgments: docs/benchmarks.md)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from bench import heldout_trace as ht
from lab.traces import load_trace


def _write(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> Path:
    out = tmp_path / "heldout.jsonl"
    ht.main(["--out", str(out), "--num-requests", "600", *extra])
    assert re.search(r"^RESULT heldout_trace num_requests=600 ", capsys.readouterr().out, re.M)
    return out


def test_loads_with_real_arrivals_rescaled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, capsys)
    requests = load_trace(str(path), rps=4.0, duration_s=30.0, num_requests=None)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert len(requests) == 120  # rps x duration rows, the last one cut at the duration
    assert all(1 <= r.input_len <= ht.MAX_PROMPT for r in requests)
    assert all(ht.MIN_OUTPUT <= r.output_len <= ht.MAX_OUTPUT for r in requests)


def test_mix_and_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chat_only = _write(tmp_path, capsys, "--mix", "1", "0", "0", "--turns", "1")
    prompts = [r.input_len for r in load_trace(str(chat_only), rps=None, duration_s=None,
                                               num_requests=None)]  # fmt: skip
    # chat alone: log-normal around the median, plus the 1,024-token system prompt
    assert 1024 + 400 < float(np.median(prompts)) < 1024 + 900
    assert np.mean(np.array(prompts) > ht.LONG_DOC[0] + 1024) < 0.02  # no long documents
    first = chat_only.read_text()
    again = _write(tmp_path, capsys, "--mix", "1", "0", "0", "--turns", "1")
    assert again.read_text() == first
    other = _write(tmp_path, capsys, "--mix", "1", "0", "0", "--turns", "1", "--seed", "8")
    assert other.read_text() != first


def test_mix_refused_when_meaningless() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="--mix"):
        ht.sample_lengths(10, [0, 0, 0], 600, 250, rng)
