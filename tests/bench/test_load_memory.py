"""bench/load_memory.py: the bench's copy of the old loader agrees with the streaming loader on
its built checkpoint, and ``--quick`` runs end to end with a parsable RESULT line. No memory
figures are asserted but the old loader's (dict + fp32 model: over 2x at any size): at ~10 MiB
the streaming loader's fixed costs (code paths used the first time) dominate its figure."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from bench import load_memory as lm
from data_plane.models import load_model

RESULT_RE = re.compile(
    r"^RESULT load_memory peak_ratio=(\S+) old_peak_ratio=(\S+) checkpoint_mib=(\S+)$"
)


def test_old_loader_copy_matches_the_streaming_loader(tmp_path: Path) -> None:
    lm.build_checkpoint(tmp_path, lm.QUICK, shard_mib=4.0)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    old = lm.old_load(tmp_path).state_dict()
    new = load_model(str(tmp_path), dtype="bfloat16").model.state_dict()
    assert old.keys() == new.keys()
    for name, tensor in new.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, old[name]), name


def test_quick_run_ends_with_the_result_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert lm.main(["--quick"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    match = RESULT_RE.match(lines[-1])
    assert match, lines[-1]
    ratio, old_ratio, checkpoint_mib = (float(value) for value in match.groups())
    assert ratio > 0 and old_ratio > 2.0
    assert 5.0 < checkpoint_mib < 20.0
    assert any(line.startswith("streaming ") for line in lines)
    assert any(line.startswith("old ") for line in lines)
