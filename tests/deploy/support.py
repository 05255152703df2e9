"""What the deployment tests share: the repository's paths, the `superinfer` CLI's subcommands,
and the check that a container's command line and SUPERINFER_* environment make a valid service
start (the same parsing `superinfer` does in the container)."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from superinfer.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "superinfer"
SCHEMAS = Path(__file__).resolve().parent / "schemas"

# The settings class each long-running subcommand builds from its flags and environment.
SETTINGS = {
    "data-plane": ("data_plane.settings", "WorkerSettings"),
    "control-plane": ("control_plane.settings", "ControlPlaneSettings"),
    "gateway": ("gateway.settings", "GatewaySettings"),
}


def require(module: str) -> None:
    """Skip without ``module`` (a dev extra); under CI (CI=true) fail instead, so that the
    deployment checks cannot silently stop running there."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        message = f"{module} is not installed (pip install -e '.[dev]'): {exc}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("superinfer has no subcommands")


def parse_command(argv: Sequence[str]) -> argparse.Namespace:
    """``superinfer ARGV`` parsed by the real CLI parser (SystemExit on a bad flag). A command
    whose subcommand is not in the CLI yet (`gateway` while it is being added) skips."""
    assert argv, "empty command"
    if argv[0] not in subcommands():
        pytest.skip(f"`superinfer {argv[0]}` is not in the CLI yet")
    return build_parser().parse_args(list(argv))


def settings_class(command: str) -> type[BaseSettings]:
    module, name = SETTINGS[command]
    try:
        cls: type[BaseSettings] = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        pytest.skip(f"{module}.{name} does not exist yet")
    return cls


def start_settings(
    argv: Sequence[str], env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch
) -> BaseSettings:
    """The settings ``superinfer ARGV`` would run with under ``env``: every SUPERINFER_*
    variable must name a field of the service's settings, and the values must parse."""
    args = parse_command(argv)
    cls = settings_class(argv[0])
    prefix = "SUPERINFER_"
    for name in list(os.environ):
        if name.startswith(prefix):
            monkeypatch.delenv(name)
    unknown = sorted(
        k for k in env if k.startswith(prefix) and k[len(prefix) :].lower() not in cls.model_fields
    )
    assert not unknown, f"{argv[0]}: {unknown} are not settings of {cls.__name__}"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    overrides = {
        k: v for k, v in vars(args).items() if k in cls.model_fields and v is not None
    }  # as superinfer.cli._run_service does
    return cls(**overrides)
