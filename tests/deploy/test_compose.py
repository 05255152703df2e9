"""docker-compose.yml: valid Compose (the Compose Specification schema that `docker-compose
config` uses, and the real command when one is installed), every superinfer service runs a
`superinfer` subcommand the CLI accepts with settings its service knows, and the parts a user
relies on (GPU reservation, CPU profile, published port, admin token, non-root) are there."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.support import REPO, SCHEMAS, require, start_settings

COMPOSE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
SUPERINFER_SERVICES = ("control-plane", "gateway", "data-plane", "data-plane-cpu")

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<name>\w+)(?:(?P<sep>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>\w+))"
)


def env_file(path: Any = ENV_EXAMPLE) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["name"] or m["bare"]
        sep, arg = m["sep"], m["arg"] or ""
        present = name in env and (env[name] != "" or not (sep or "").startswith(":"))
        if sep and sep.endswith("?") and not present:
            raise ValueError(f"{name}: {arg}")
        if sep and sep.endswith("-") and not present:
            return arg
        return env.get(name, "")

    return _VAR.sub(substitute, value)


def load(env: dict[str, str] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = interpolate(
        yaml.safe_load(COMPOSE.read_text()), env_file() if env is None else env
    )
    return config


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load()


def test_compose_file_matches_the_compose_schema(compose: dict[str, Any]) -> None:
    require("jsonschema")
    import jsonschema

    schema = json.loads((SCHEMAS / "compose_spec.json").read_text())
    jsonschema.Draft201909Validator(schema).validate(compose)
    broken = json.loads(json.dumps(compose))
    broken["services"]["gateway"]["prots"] = ["8000:8000"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft201909Validator(schema).validate(broken)


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    return None


# ids other than a bare "gpu": tests/conftest.py skips items with a `gpu` keyword without CUDA
@pytest.mark.parametrize("profile", ["cpu", "gpu"], ids=["cpu-profile", "gpu-profile"])
def test_docker_compose_config(profile: str) -> None:
    command = compose_command()
    if command is None:
        pytest.skip("no docker-compose / docker compose here (the schema test covers the file)")
    base = [*command, "--env-file", str(ENV_EXAMPLE), "--profile", profile, "-f", str(COMPOSE)]
    result = subprocess.run([*base, "config"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert {"redis", "control-plane", "gateway"} <= set(services)
    assert ("data-plane" if profile == "gpu" else "data-plane-cpu") in services


def test_admin_token_is_required(tmp_path: Path) -> None:
    env = {k: v for k, v in env_file().items() if k != "SUPERINFER_ADMIN_TOKEN"}
    with pytest.raises(ValueError, match="SUPERINFER_ADMIN_TOKEN"):
        load(env)
    command = compose_command()
    if command is not None:
        (tmp_path / "empty.env").write_text("")
        result = subprocess.run(
            [*command, "-f", str(COMPOSE), "--env-file", str(tmp_path / "empty.env"), "config"],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={k: v for k, v in os.environ.items() if not k.startswith("SUPERINFER_")},
        )
        assert result.returncode != 0 and "SUPERINFER_ADMIN_TOKEN" in result.stderr


@pytest.mark.parametrize("service", SUPERINFER_SERVICES)
def test_services_run_superinfer_commands_with_known_settings(
    service: str, compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = compose["services"][service]
    assert "entrypoint" not in spec  # the image's: `superinfer`
    command = spec["command"]
    assert command[0] == service.removesuffix("-cpu")
    env = {k: str(v) for k, v in spec["environment"].items()}
    settings: Any = start_settings(command, env, monkeypatch)
    assert settings.redis_url == "redis://redis:6379/0"
    if service.startswith("data-plane"):
        assert settings.health_port == 9090
    if service == "control-plane":
        assert settings.knobs == {"policy": "lvf", "b_xfer": "auto"}


def test_gpu_worker_reserves_a_gpu_and_cpu_worker_runs_tiny_random(
    compose: dict[str, Any],
) -> None:
    gpu = compose["services"]["data-plane"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["environment"]["SUPERINFER_DEVICE"] == "cuda"
    assert any(v.endswith(":/models:ro") for v in gpu["volumes"])
    cpu = compose["services"]["data-plane-cpu"]
    assert cpu["profiles"] == ["cpu"] and "deploy" not in cpu
    assert cpu["environment"]["SUPERINFER_MODEL"] == "tiny-random"
    assert cpu["environment"]["SUPERINFER_DEVICE"] == "cpu"


def test_gateway_published_and_everything_non_root(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    assert gateway["ports"] == ["8000:8000"]
    assert gateway["environment"]["SUPERINFER_ADMIN_TOKEN"] == env_file()["SUPERINFER_ADMIN_TOKEN"]
    for name, spec in compose["services"].items():
        assert spec["read_only"] is True, name
        assert not str(spec["user"]).startswith("0"), name
        assert spec["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in spec["security_opt"], name
    for name in SUPERINFER_SERVICES:
        assert compose["services"][name]["depends_on"]["redis"]["condition"] == "service_healthy"
