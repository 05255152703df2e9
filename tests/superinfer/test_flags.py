"""Flags generated from the settings models: one declaration per setting."""

from __future__ import annotations

import argparse

import pytest
from redis.asyncio import Redis

from control_plane.settings import ControlPlaneSettings
from data_plane.settings import WorkerSettings
from gateway.settings import GatewaySettings
from shared.knobs import read_knobs, write_knobs
from superinfer.cli import SECRET_FIELDS, build_parser
from superinfer.flags import add_settings_flags
from superinfer.serve import WORKER_MODEL_FIELDS, _worker_args, _write_knob_flags
from tests.redis_support import redis_url


def _subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize(
    ("command", "settings_cls"),
    [
        ("data-plane", WorkerSettings),
        ("control-plane", ControlPlaneSettings),
        ("gateway", GatewaySettings),
    ],
)
def test_every_setting_is_a_flag_and_no_secret_is(command: str, settings_cls: type) -> None:
    dests = {a.dest for a in _subcommand(command)._actions}
    fields = set(settings_cls.model_fields)
    assert fields - set(SECRET_FIELDS) <= dests
    assert not dests & set(SECRET_FIELDS)


def test_flag_values_reach_the_settings_with_their_types() -> None:
    args = build_parser().parse_args(
        ["data-plane", "--max-model-len", "2048", "--gpu-memory-utilization", "0.5", "--model", "m"]
    )
    assert args.max_model_len == 2048 and args.gpu_memory_utilization == 0.5
    args = build_parser().parse_args(["gateway", "--require-api-key", "--no-admin-disabled"])
    assert args.require_api_key is True and args.admin_disabled is False


def test_literal_auto_and_json_settings_are_flags_too() -> None:
    args = build_parser().parse_args(["gateway", "--tool-call-parser", "hermes"])
    assert GatewaySettings(tool_call_parser=args.tool_call_parser).tool_call_parser == "hermes"
    with pytest.raises(SystemExit):  # not one of the parsers: argparse names the choices
        build_parser().parse_args(["gateway", "--tool-call-parser", "mistral"])
    args = build_parser().parse_args(["data-plane", "--model", "m", "--b-xfer", "auto"])
    assert WorkerSettings(model="m", b_xfer=args.b_xfer).b_xfer is None  # auto: measured
    args = build_parser().parse_args(["data-plane", "--model", "m", "--b-xfer", "300"])
    assert WorkerSettings(model="m", b_xfer=args.b_xfer).b_xfer == 300
    with pytest.raises(SystemExit):
        build_parser().parse_args(["data-plane", "--model", "m", "--b-xfer", "lots"])
    argv = ["control-plane", "--knobs", '{"policy": "lvf", "b_xfer": 75}']
    knobs = ControlPlaneSettings(knobs=build_parser().parse_args(argv).knobs).knobs
    assert knobs == {"policy": "lvf", "b_xfer": 75}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["control-plane", "--knobs", "[1, 2]"])
    passed = _worker_args(build_parser().parse_args(["serve", "--b-xfer", "auto"]))
    assert passed == ["--b-xfer", "auto"]


def test_serve_passes_the_worker_fields_through_unchanged() -> None:
    argv = ["serve", "--max-model-len", "4096", "--swap-space", "2.5", "--dtype", "bfloat16"]
    args = build_parser().parse_args(argv)
    passed = _worker_args(args)
    assert passed == ["--dtype", "bfloat16", "--max-model-len", "4096", "--swap-space", "2.5"]
    worker = build_parser().parse_args(["data-plane", *passed])
    assert (worker.max_model_len, worker.swap_space, worker.dtype) == (4096, 2.5, "bfloat16")
    assert set(WORKER_MODEL_FIELDS) <= set(WorkerSettings.model_fields)


def test_serve_passes_switches_as_switches() -> None:
    argv = ["serve", "--no-enable-prefix-caching", "--dram-prefix-caching"]
    passed = _worker_args(build_parser().parse_args(argv))
    assert passed == ["--no-enable-prefix-caching", "--dram-prefix-caching"]
    worker = build_parser().parse_args(["data-plane", *passed])
    assert worker.enable_prefix_caching is False and worker.dram_prefix_caching is True


def test_an_unknown_field_is_an_error() -> None:
    with pytest.raises(ValueError, match="no such field"):
        add_settings_flags(argparse.ArgumentParser(), WorkerSettings, ["no_such_field"])


def test_serve_takes_the_gateways_environment_unless_a_flag_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`serve` passed every gateway flag's default explicitly, and an explicit value beats
    the environment: SUPERINFER_PORT, _SERVED_MODEL_NAME, _ALLOWED_ORIGINS... were ignored
    (the worker, reading its own environment, then named the model otherwise)."""
    from superinfer.serve import _gateway_settings

    env = {
        "SUPERINFER_PORT": "8123",
        "SUPERINFER_SERVED_MODEL_NAME": "from-env",
        "SUPERINFER_ALLOWED_ORIGINS": '["https://a.example"]',
        "SUPERINFER_ENABLE_AUTO_TOOL_CHOICE": "true",
        "SUPERINFER_TOOL_CALL_PARSER": "hermes",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = _subcommand("serve").parse_args(["--model", "tiny-random"])
    settings = _gateway_settings(args, "redis://x/0", "t" * 32)
    assert (settings.port, settings.host) == (8123, "127.0.0.1")
    assert settings.served_model_name == "from-env"
    assert settings.allowed_origins == ["https://a.example"]
    assert settings.enable_auto_tool_choice and settings.tool_call_parser == "hermes"
    given = _subcommand("serve").parse_args(
        ["--model", "tiny-random", "--port", "9000", "--served-model-name", "flag"]
    )
    settings = _gateway_settings(given, "redis://x/0", "t" * 32)
    assert (settings.port, settings.served_model_name) == (9000, "flag")


def test_bench_takes_vllms_names_and_refuses_no_requests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`vllm bench serve`'s --request-rate and --num-prompts are ours; --num-requests 0 ran
    nothing and printed 100 % attainment."""
    base = ["bench", "--base-url", "http://127.0.0.1:1", "--trace", "synthetic:8:8"]
    args = build_parser().parse_args([*base, "--request-rate", "4", "--num-prompts", "12"])
    assert (args.rps, args.num_requests) == (4.0, 12)
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--rps", "4", "--num-requests", "0"])
    assert "--num-requests" in capsys.readouterr().err


def test_long_prefill_token_threshold_defaults_by_device_and_takes_vllms_flag() -> None:
    """512 on the CPU (a CPU step of 2,048 prompt tokens held a short request 5.8 s behind a
    long prompt: bench/long_prefill.py), vLLM's 0 elsewhere; the flag wins."""
    from data_plane.settings import WorkerSettings

    assert WorkerSettings().resolved_long_prefill_token_threshold() == 512
    assert WorkerSettings(device="cuda").resolved_long_prefill_token_threshold() == 0
    given = build_parser().parse_args(["data-plane", "--long-prefill-token-threshold", "0"])
    settings = WorkerSettings(long_prefill_token_threshold=given.long_prefill_token_threshold)
    assert settings.resolved_long_prefill_token_threshold() == 0


async def test_serve_writes_b_xfer_over_knobs_already_in_redis(redis_client: Redis) -> None:
    """``serve --b-xfer`` alone (no ``--policy``) is written too: before, it only seeded an
    empty Redis, so with knobs there it was accepted and ignored."""
    await write_knobs(redis_client, {"policy": "vllm"})
    url = redis_url()
    await _write_knob_flags(url, None, 100)
    knobs, _ = await read_knobs(redis_client)
    assert (knobs.policy, knobs.b_xfer) == ("vllm", 100)
    await _write_knob_flags(url, "lvf", "auto")
    knobs, _ = await read_knobs(redis_client)
    assert (knobs.policy, knobs.b_xfer) == ("lvf", None)
