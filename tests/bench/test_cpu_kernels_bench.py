"""bench/cpu_kernels.py runs end to end (one short round) and prints its RESULT line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from data_plane.models import cpu_kernels
from tests.conftest import STORIES_DIR

REPO = Path(__file__).resolve().parents[2]


def test_the_bench_alternates_and_reports() -> None:
    model = STORIES_DIR / "stories260K.bin"  # small: the bench's code paths, not its figures
    if not model.is_file():
        pytest.skip("../shared/models/stories260K is not present")
    if cpu_kernels.kernels() is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    args = ["--model", str(model), "--batches", "2", "--rounds", "1", "--steps", "2"]
    args += ["--threads", "1"]
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "cpu_kernels.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = done.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT cpu_kernels torch_ms_b2=")
    assert "speedup_b2=" in result
