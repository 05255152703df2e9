"""bench/gpu/run_all.sh cannot rot between device runs: its CPU dry run (every part on the CPU
with a tiny model; CUDA-only parts checked for their imports and arguments) runs here and must
return what a device run returns: $OUT with at most the three files the device brings back (the
archive, summary.txt, results.txt), the archive holding every part's log, and a RESULT line
for every part. The kit's install unpacks a missing module from its wheel without pip."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from bench.gpu import kit

ROOT = Path(__file__).resolve().parents[2]
KIT = Path(os.environ.get("SUPERINFER_KIT", ROOT.parent / "shared"))
PARTS = [
    "kit_check", "gpu_tests", "decode_step", "rotation_overlap", "sampler", "policy_e2e",
    "duplexkv", "profile",
]  # fmt: skip


def test_the_dry_run_returns_one_archive_with_every_part(tmp_path: Path) -> None:
    if not (KIT / "traces").is_dir():
        pytest.skip("the kit's traces are not beside the checkout")
    kit_dir = tmp_path / "kit"
    kit_dir.mkdir()
    for name in ("models", "traces"):
        (kit_dir / name).symlink_to(KIT / name)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "SUPERINFER_KIT": str(kit_dir), "PYTHON": sys.executable}
    env["WORK"] = str(tmp_path / "work")
    done = subprocess.run(
        ["bash", "bench/gpu/run_all.sh", "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu-results.tar.gz", "results.txt", "summary.txt",
    ]  # fmt: skip
    with tarfile.open(out / "gpu-results.tar.gz") as archive:
        names = {Path(n).name for n in archive.getnames()}
    assert {f"{part}.log" for part in PARTS} <= names
    assert {"decode_step.json", "policy_e2e.json", "profile.json", "results.txt"} <= names
    results = (out / "results.txt").read_text().splitlines()
    assert [line.split()[1] for line in results] == PARTS, results
    assert not [line for line in results if "missing" in line], results
    assert "failed=0" in results[0]  # every module the parts import imports


def test_the_kit_unpacks_a_missing_module_from_its_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = "superinfer_kit_probe"
    wheels = tmp_path / "kit" / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / "superinfer_kit_probe-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{module}/__init__.py", "VALUE = 42\n")
    monkeypatch.setattr(kit, "WHEELS", {"superinfer-kit-probe": module, "structlog": "structlog"})
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert kit.install(tmp_path / "kit") == 0
    assert (tmp_path / "kit" / "site" / module / "__init__.py").exists()
    assert not (tmp_path / "kit" / "site" / "structlog").exists()  # importable: left alone
    probe = __import__(module)
    assert probe.VALUE == 42
    sys.modules.pop(module, None)
