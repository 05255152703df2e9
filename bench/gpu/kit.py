"""The GPU kit: what bench/gpu/run_all.sh needs on a device host that has torch, CUDA,
cuda-bindings, transformers and triton but nothing else of ours and no network.

- ``download`` (on the build host, ``make gpu-kit``): the kit's models and traces copied from
  the kit beside the checkout, and a wheel of every package the GPU parts import that such a
  host may lack (Python 3.12, manylinux x86_64, no dependencies: the list is complete).
- ``install`` (on the device host, first thing in run_all.sh): each of those packages whose
  module does not import is unpacked from its wheel into ``.gpu-kit/site`` (no pip, no
  network: a wheel is a zip), which run_all.sh puts on PYTHONPATH.
- ``check``: every module the parts import imports, before minutes are spent; exits 1 naming
  what does not.

    python bench/gpu/kit.py download|install|check [--kit .gpu-kit]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# pip project -> the module it provides: what the GPU parts (the data plane, its tests and
# benches) import beyond torch, triton, transformers and their own dependencies.
WHEELS = {
    "structlog": "structlog",
    "msgpack": "msgpack",
    "redis": "redis",
    "pydantic": "pydantic",
    "pydantic-core": "pydantic_core",
    "annotated-types": "annotated_types",
    "typing-inspection": "typing_inspection",
    "pydantic-settings": "pydantic_settings",
    "python-dotenv": "dotenv",
    "gguf": "gguf",
    "pytest": "pytest",
    "pluggy": "pluggy",
    "iniconfig": "iniconfig",
    "pytest-asyncio": "pytest_asyncio",
    "pytest-timeout": "pytest_timeout",
    "hypothesis": "hypothesis",
    "sortedcontainers": "sortedcontainers",
    "attrs": "attr",
}
# What the parts import (a module that fails here would fail a part minutes in).
PART_MODULES = [
    "data_plane.engine.llm",
    "data_plane.engine.model_runner",
    "data_plane.kv.tiered",
    "data_plane.transfer.cuda",
    "data_plane.models.triton_attention",
    "data_plane.models.paged_batch",
    "lab.profile",
    "bench.gpu.decode_step",
    "bench.gpu.rotation_overlap",
    "bench.gpu.policy_e2e",
    "bench.gpu.duplexkv",
    "bench.sampler",
    "pytest",
    "pytest_asyncio",
    "pytest_timeout",
    "hypothesis",
]


def download(kit: Path, shared: Path) -> int:
    kit.mkdir(parents=True, exist_ok=True)
    for name in ("models", "traces"):
        if (shared / name).is_dir():
            shutil.copytree(shared / name, kit / name, dirs_exist_ok=True)
    wheels = kit / "wheels"
    wheels.mkdir(exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.12", "--implementation", "cp",
        "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
        "--platform", "any", "--dest", str(wheels), *WHEELS,
    ]  # fmt: skip
    return subprocess.run(command, check=False).returncode


def install(kit: Path) -> int:
    """Unpack the wheel of every kit package whose module is missing into kit/site."""
    site = kit / "site"
    site.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(site))
    wheels = sorted((kit / "wheels").glob("*.whl"))
    missing = []
    for project, module in WHEELS.items():
        if importlib.util.find_spec(module) is not None:
            continue
        stem = project.replace("-", "_").lower()
        found = [w for w in wheels if w.name.lower().startswith(stem + "-")]
        if not found:
            missing.append(project)
            continue
        with zipfile.ZipFile(found[-1]) as wheel:
            wheel.extractall(site)
        print(f"installed {found[-1].name} into {site}")
    if missing:
        print(f"not in the kit and not installed: {', '.join(missing)}")
    return 0


def check() -> int:
    failed = []
    for module in PART_MODULES:
        try:
            importlib.import_module(module)
        except Exception as exc:  # any failure to import is what this reports
            failed.append(f"{module}: {type(exc).__name__}: {exc}")
    for line in failed:
        print(f"import failed: {line}")
    print(f"RESULT kit_check modules={len(PART_MODULES)} failed={len(failed)}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("download", "install", "check"))
    parser.add_argument("--kit", type=Path, default=ROOT / ".gpu-kit")
    parser.add_argument("--shared", type=Path, default=ROOT.parent / "shared")
    args = parser.parse_args(argv)
    if args.command == "download":
        return download(args.kit, args.shared)
    if args.command == "install":
        return install(args.kit)
    sys.path.insert(0, str(ROOT))
    return check()


if __name__ == "__main__":
    raise SystemExit(main())
