"""The fault suite (``tests/faults``) beside CPU hogs: one busy-looping process per core runs
for the whole suite, so every service of the system under test (Redis, control plane, worker,
gateway, the load clients) fights for the cores, as on a shared or overcommitted host.

Runs the suite ``--runs`` times with the hogs (and once without them first, as the baseline in
the same run unless ``--no-baseline``), each with pytest's own result, and records the load
average. Last line: ``RESULT faults_under_hog passed=... failed=... runs=... hog_s=...
alone_s=... load_avg=...``.

    .venv/bin/python bench/faults_under_hog.py [--runs 1] [--hogs N] [--no-baseline]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"(\d+) passed|(\d+) failed|(\d+) error")


def _hog(stop: mp.synchronize.Event) -> None:  # type: ignore[name-defined]
    value = 0
    while not stop.is_set():
        for i in range(100_000):
            value ^= i


def _suite() -> tuple[int, int, float, str]:
    """One run of tests/faults: passed, failed (errors included), seconds, its summary line."""
    t_start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/faults"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.monotonic() - t_start
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else result.stderr[-300:]
    passed = failed = 0
    for match in SUMMARY.finditer(summary):
        passed += int(match[1] or 0)
        failed += int(match[2] or 0) + int(match[3] or 0)
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    return passed, failed, seconds, "\n".join([summary, *failures])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="suite runs beside the hogs")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without hogs")
    args = parser.parse_args(argv)
    alone_s = 0.0
    if not args.no_baseline:
        passed, failed, alone_s, summary = _suite()
        print(f"alone: {passed} passed, {failed} failed in {alone_s:.0f} s\n{summary}")
    total_passed = total_failed = 0
    hog_s: list[float] = []
    loads: list[float] = []
    for run in range(args.runs):
        stop = mp.Event()
        hogs = [mp.Process(target=_hog, args=(stop,), daemon=True) for _ in range(args.hogs)]
        for hog in hogs:
            hog.start()
        try:
            passed, failed, seconds, summary = _suite()
            loads.append(os.getloadavg()[0])
        finally:
            stop.set()
            for hog in hogs:
                hog.join(timeout=5)
        total_passed, total_failed = total_passed + passed, total_failed + failed
        hog_s.append(seconds)
        print(
            f"run {run + 1} beside {args.hogs} hogs: {passed} passed, {failed} failed in "
            f"{seconds:.0f} s (load {loads[-1]:.2f})\n{summary}"
        )
    print(
        f"RESULT faults_under_hog passed={total_passed} failed={total_failed} runs={args.runs} "
        f"hog_s={max(hog_s):.0f} alone_s={alone_s:.0f} load_avg={max(loads):.2f}"
    )
    return 0 if total_failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
