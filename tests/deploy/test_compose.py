"""docker-compose.yml: valid Compose (the Compose Specification schema that `docker-compose
config` uses, and the real command when one is installed), every superinfer service runs a
`superinfer` subcommand the CLI accepts with settings its service knows, and the parts a user
relies on (GPU reservation, CPU profile, the gateway on loopback, the admin token and Redis
password required and their placeholders refused, Redis bounded and persistent, non-root) are
there."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.support import (
    REPO,
    SCHEMAS,
    redis_from_script,
    require,
    run_redis_script,
    start_settings,
)

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


# A .env as the user edits it: .env.example with its placeholders replaced.
ADMIN_TOKEN = "0123456789abcdef0123456789abcdef"
REDIS_PASSWORD = "fedcba9876543210fedcba9876543210"


def edited_env(**changes: str) -> dict[str, str]:
    env = {
        **env_file(),
        "SUPERINFER_ADMIN_TOKEN": ADMIN_TOKEN,
        "SUPERINFER_REDIS_PASSWORD": REDIS_PASSWORD,
    }
    return {**env, **changes}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(edited_env())


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


@pytest.mark.parametrize("name", ["SUPERINFER_ADMIN_TOKEN", "SUPERINFER_REDIS_PASSWORD"])
def test_secrets_are_required(name: str, tmp_path: Path) -> None:
    env = {k: v for k, v in env_file().items() if k != name}
    with pytest.raises(ValueError, match=name):
        load(env)
    command = compose_command()
    if command is not None:
        without = tmp_path / "without.env"
        without.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        result = subprocess.run(
            [*command, "-f", str(COMPOSE), "--env-file", str(without), "config"],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={k: v for k, v in os.environ.items() if not k.startswith("SUPERINFER_")},
        )
        assert result.returncode != 0 and name in result.stderr


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
    assert settings.redis_url == f"redis://:{REDIS_PASSWORD}@redis:6379/0"
    if service == "gateway":
        assert settings.admin_token == ADMIN_TOKEN
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
    other = load(edited_env(SUPERINFER_MODEL="/models/llama"))["services"]
    serving = ("gateway", "data-plane", "data-plane-cpu")  # the control plane loads no model
    models = {name: other[name]["environment"]["SUPERINFER_MODEL"] for name in serving}
    assert set(models.values()) == {"/models/llama"}, models  # every worker serves the gateway's


def test_the_gateway_is_stopped_after_its_shutdown_grace(compose: dict[str, Any]) -> None:
    """Docker's default stop period (10 s) killed streams the gateway was still finishing."""
    from gateway.settings import GatewaySettings

    period = compose["services"]["gateway"]["stop_grace_period"]
    assert period.endswith("s") and int(period[:-1]) > GatewaySettings().shutdown_grace_s


def test_gateway_published_on_loopback_unless_asked(compose: dict[str, Any]) -> None:
    assert env_file()["SUPERINFER_BIND"] == "127.0.0.1"
    assert compose["services"]["gateway"]["ports"] == ["127.0.0.1:8000:8000"]
    unset = {k: v for k, v in edited_env().items() if k != "SUPERINFER_BIND"}
    assert load(unset)["services"]["gateway"]["ports"] == ["127.0.0.1:8000:8000"]
    everywhere = load(edited_env(SUPERINFER_BIND="0.0.0.0", SUPERINFER_GATEWAY_PORT="9000"))
    assert everywhere["services"]["gateway"]["ports"] == ["0.0.0.0:9000:8000"]
    for name, spec in compose["services"].items():
        if name in ("prometheus", "grafana"):  # profile observability: loopback too
            assert [p.split(":")[0] for p in spec["ports"]] == ["127.0.0.1"], name
        elif name != "gateway":
            assert "ports" not in spec, name  # Redis and the rest: the compose network only


def test_placeholder_admin_token_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """.env.example copied unedited: the gateway refuses to start (the token is not echoed)."""
    require("pydantic")
    from pydantic import ValidationError

    placeholder = env_file()["SUPERINFER_ADMIN_TOKEN"]
    for token in (placeholder, "too-short-token"):
        spec = load(edited_env(SUPERINFER_ADMIN_TOKEN=token))["services"]["gateway"]
        env = {k: str(v) for k, v in spec["environment"].items()}
        with pytest.raises(ValidationError, match="admin_token") as refused:
            start_settings(spec["command"], env, monkeypatch)
        assert token not in str(refused.value)


def redis_script(compose: dict[str, Any]) -> str:
    command = compose["services"]["redis"]["command"]
    assert command[:2] == ["sh", "-c"] and len(command) == 3
    script: str = command[2]
    return script


def test_redis_needs_the_password_and_is_bounded_and_persistent(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    """Redis's start-up script, run with a real redis-server: the password from .env (not on
    its command line), maxmemory with noeviction, the append-only file in /data (the named
    volume); the services' URL carries the same password."""
    redis = compose["services"]["redis"]
    assert redis["environment"]["REDISCLI_AUTH"] == REDIS_PASSWORD
    assert "redis-data:/data" in redis["volumes"] and "/tmp" in redis["tmpfs"]
    assert "requirepass" in redis_script(compose)
    config = run_redis_script(redis_script(compose), REDIS_PASSWORD, tmp_path)
    assert config["requirepass"] == REDIS_PASSWORD
    assert config["maxmemory"] == str(1024**3)  # SUPERINFER_REDIS_MAXMEMORY=1gb
    assert config["maxmemory-policy"] == "noeviction"
    assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec"


def test_redis_refuses_the_placeholder_password(tmp_path: Path) -> None:
    placeholder = env_file()["SUPERINFER_REDIS_PASSWORD"]
    script = redis_script(load(edited_env(SUPERINFER_REDIS_PASSWORD=placeholder)))
    result = subprocess.run(
        ["sh", "-c", script.replace("/tmp/", f"{tmp_path}/")],
        env={"PATH": os.environ["PATH"], "REDISCLI_AUTH": placeholder},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "SUPERINFER_REDIS_PASSWORD" in result.stderr
    assert not (tmp_path / "redis.conf").exists()


def test_everything_non_root(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    assert gateway["environment"]["SUPERINFER_ADMIN_TOKEN"] == ADMIN_TOKEN
    for name, spec in compose["services"].items():
        assert spec["read_only"] is True, name
        assert not str(spec["user"]).startswith("0"), name
        assert spec["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in spec["security_opt"], name
    for name in SUPERINFER_SERVICES:
        assert compose["services"][name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_api_keys_and_knobs_survive_a_redis_restart(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    """Compose's Redis (its own start-up script, a real redis-server) killed with SIGKILL (no
    shutdown save) 1.5 s after the writes (appendfsync everysec) and started again on the same
    /data: an API key created through the gateway's code still authenticates, and the knobs
    written through the admin path read back."""
    import asyncio

    from redis.asyncio import Redis

    from gateway.auth import ApiKeyCache, create_api_key
    from shared.knobs import read_knobs, write_knobs

    script = redis_script(compose)

    async def write(url: str) -> str:
        redis = Redis.from_url(url)
        try:
            key, _ = await create_api_key(redis, "tenant-a", "batch")
            await write_knobs(redis, {"policy": "lvf", "alpha": 2.5})
            return key
        finally:
            await redis.aclose()

    async def read(url: str, key: str) -> tuple[Any, Any]:
        redis = Redis.from_url(url)
        try:
            found = await ApiKeyCache(redis).lookup(key)
            knobs, _ = await read_knobs(redis)
            return found, knobs
        finally:
            await redis.aclose()

    with redis_from_script(script, REDIS_PASSWORD, tmp_path, crash=True) as url:
        key = asyncio.run(write(url))
        time.sleep(1.5)  # one appendfsync period
    with redis_from_script(script, REDIS_PASSWORD, tmp_path) as url:
        found, knobs = asyncio.run(read(url, key))
    assert found is not None and found.tenant == "tenant-a" and found.slo_class == "batch"
    assert knobs.policy == "lvf" and knobs.alpha == 2.5
