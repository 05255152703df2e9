"""bench/worker_memory.py, short: 4,000 iterations of the worker's loop (the real engine, KV
tiers, rotation and copies; no model computing, ``--executor null``) after a warm-up of at
least 5,000 that goes on until the prefix indexes stop growing (a fixed 7,000 was not enough
in CI on a slow host: the DRAM index was still filling, 37 KiB), retain no memory per
iteration. Measured on the dev host: the unbounded ``TieredStats.per_iteration_blocks`` this
was written against grew 38 KiB over the 4,000 (91 KiB per 10k iterations); the bounded ring
3.5-10.5, and in a full suite run samples moved by up to 22 KiB either way (caches of fixed
size holding different blocks at each sample, the test process's own allocations): the bounds
(45 KiB per 10k by least squares over 9 samples, 45 KiB first to last) sit between that noise
and the leak."""

from __future__ import annotations

import re

import pytest

from bench import worker_memory as wm

RESULT_RE = re.compile(
    r"^RESULT worker_memory iterations=(\d+) traced_growth_kib=(\S+) objects_growth=(-?\d+)"
    r" load_avg=(\S+)$"
)


def _number(pattern: str, lines: list[str], prefix: str) -> float:
    line = next(line for line in lines if line.startswith(prefix))
    match = re.search(pattern, line)
    if match is None:
        raise AssertionError(f"{pattern!r} not in {line!r}")
    return float(match[1])


def test_worker_memory_is_flat(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--iterations", "4000", "--warmup", "5000", "--samples", "8"]
    assert wm.main([*argv, "--executor", "null", "--model", "tiny-random"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    match = RESULT_RE.match(lines[-1])
    assert match, lines[-1]
    iterations, traced_kib, objects = int(match[1]), float(match[2]), int(match[3])
    assert iterations >= 4000
    slope_kib = _number(r"traced (-?[\d.]+) KiB", lines, "growth per 10k")
    assert traced_kib < 45, "\n".join(lines)
    assert slope_kib < 45, "\n".join(lines)
    assert objects < 200, "\n".join(lines)
    assert _number(r"rotations out (\d+)", lines, "requests added") > 100  # tiered paths ran
