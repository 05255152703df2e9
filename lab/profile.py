"""`superinfer profile`: fit a cost profile (``lab/costmodel.py``) of a model on this machine.

The real engine (model, paged KV, policy) runs a small grid of batches: single prompts of
several lengths (prefill), then decode batches of several sizes at several context lengths.
Every engine step is timed whole (planning and bookkeeping included, as a served iteration
pays them) and described the way the simulator's executor describes it (prefill tokens, decode
sequences, context tokens). The fit (``lab/profile_fit.py``: the median time of each
step shape, least squares of the relative error, coefficients >= 0, shapes far off dropped)::

    step_s = intercept + prefill_token_s * prefill_tokens + context_token_s * context_tokens

maps onto the profile's physical constants with the model's real sizes: the KV bytes per token
over ``context_token_s`` is the effective ``hbm_bandwidth_bytes_s``; the weight-read term
``weight_bytes / hbm_bandwidth_bytes_s`` plus ``fixed_overhead_s`` is the intercept (when the real
weights at that rate would exceed it, ``weight_bytes`` becomes the effective bytes the intercept
reads); ``flops_per_token`` (2 x parameters) over ``prefill_token_s`` is ``peak_flops``. So the
profile's ``iteration_time_s`` is the fitted step time. The KV link is
measured with the transfer backend itself (``cpu`` on a CPU: two copy threads). The result is
a JSON profile that ``superinfer simulate --profile PATH`` reads, with how each constant was
obtained under ``_sources`` and the fit itself under ``_fit``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lab.costmodel import profile_to_dict
from lab.profile_fit import (
    ModelSizes,
    StepSample,
    build_profile,
    fit_step_costs,
)

if TYPE_CHECKING:
    from data_plane.engine.engine import Engine
    from data_plane.engine.executor import BatchItem, Executor, Sampled

_LINK_BLOCKS = 256  # blocks copied each way to measure the KV link


def batch_shape(items: list[BatchItem]) -> tuple[int, int, int]:
    """(prefill tokens, decode sequences, context tokens) of a batch, counted as
    ``lab.sim.executor.SimulatedExecutor`` counts them."""
    prefill = decodes = context = 0
    for item in items:
        start = item.request.num_computed_tokens
        context += start + item.num_tokens
        if item.num_tokens == 1 and start > 0:
            decodes += 1
        else:
            prefill += item.num_tokens
    return prefill, decodes, context


# ---- measuring the engine --------------------------------------------------------------


class _ShapeRecorder:
    """Wraps the engine's executor and remembers the shape of the batch it last ran."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.last_shape: tuple[int, int, int] | None = None

    def execute(self, items: list[BatchItem]) -> Sampled:
        self.last_shape = batch_shape(items)
        return self.inner.execute(items)


def _timed_steps(engine: Engine, recorder: _ShapeRecorder) -> list[StepSample]:
    """Step ``engine`` until it is idle; one sample per step that ran a batch."""
    samples: list[StepSample] = []
    while engine.has_unfinished():
        recorder.last_shape = None
        t0 = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t0
        if recorder.last_shape is not None:
            samples.append(StepSample(*recorder.last_shape, seconds))
    return samples


def _add(engine: Engine, request_id: str, num_prompt: int, num_output: int, seed: int) -> None:
    from data_plane.engine.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size or 256
    prompt = rng.integers(3, max(4, vocab), size=num_prompt).tolist()
    params = SamplingParams(max_tokens=num_output, temperature=0.0, ignore_eos=True)
    engine.add_request(request_id, prompt, params)


@dataclass(frozen=True, slots=True)
class Grid:
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256)
    decode_batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (32, 128, 256)
    num_decode_steps: int = 8
    repeats: int = 3

    def fitted_to(self, max_model_len: int) -> Grid:
        """The grid without lengths the model cannot hold."""
        limit = max_model_len - self.num_decode_steps - 2
        return Grid(
            tuple(p for p in self.prefill_tokens if p < limit) or (min(8, limit),),
            self.decode_batches,
            tuple(c for c in self.contexts if c < limit) or (min(8, limit),),
            self.num_decode_steps,
            self.repeats,
        )


def measure_engine(engine: Engine, grid: Grid) -> list[StepSample]:
    """Samples of the grid: prefills alone, then decode batches (their prefill steps count
    too). The first pass is a warm-up and is dropped."""
    recorder = _ShapeRecorder(engine.executor)
    engine.executor = recorder  # type: ignore[assignment]
    _add(engine, "warmup", grid.prefill_tokens[0], 4, 0)
    _timed_steps(engine, recorder)
    samples: list[StepSample] = []
    for repeat in range(grid.repeats):
        for num_prompt in grid.prefill_tokens:
            _add(engine, f"p{num_prompt}-{repeat}", num_prompt, 1, repeat)
            samples += _timed_steps(engine, recorder)
        for batch in grid.decode_batches:
            for context in grid.contexts:
                for i in range(batch):
                    request_id = f"d{batch}-{context}-{repeat}-{i}"
                    _add(engine, request_id, context, grid.num_decode_steps, repeat * 1000 + i)
                samples += _timed_steps(engine, recorder)
    engine.executor = recorder.inner
    return samples


def measure_link(geometry: Any, backend: str, device: str) -> tuple[float, float, float]:
    """(H2D, D2H, both-at-once aggregate) bytes/s of ``backend`` moving whole blocks."""
    from data_plane.transfer import BlockCopy, make_transfer_engine

    hbm = geometry.allocate(_LINK_BLOCKS, device)
    # The cuda backend needs page-locked host memory (as the worker's pinned DRAM pool is).
    dram = geometry.allocate(_LINK_BLOCKS, "cpu", pin=str(device).startswith("cuda"))
    engine = make_transfer_engine(backend, hbm, dram)
    scattered = np.random.default_rng(0).permutation(_LINK_BLOCKS).tolist()
    copies = [BlockCopy(i, dst) for i, dst in enumerate(scattered)]  # no adjacent runs
    nbytes = _LINK_BLOCKS * geometry.block_bytes

    def timed(h2d: list[BlockCopy], d2h: list[BlockCopy]) -> float:
        best_s = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for handle in engine.submit(h2d, d2h):
                if handle is not None:
                    handle.wait()
            best_s = min(best_s, time.perf_counter() - t0)
        return max(best_s, 1e-9)

    h2d_rate = nbytes / timed(copies, [])
    d2h_rate = nbytes / timed([], copies)
    both_rate = 2 * nbytes / timed(copies, copies)
    engine.close()
    return h2d_rate, d2h_rate, both_rate


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"expected integers >= 1, got {text!r}")
    return values


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="tiny-random", help="HF dir, llama2.c .bin, or tiny-random")
    add("--tokenizer", default=None)
    add("--dtype", default=None)
    add("--quantization", default=None, help="auto | gguf | none (as serve's)")
    add("--device", default="cpu")
    add("--block-size", type=int, default=16)
    add("--transfer-backend", default="cpu", help="the KV link to measure: cpu, cuda, naive")
    add("--prefill-tokens", default="16,64,128,256", help="prompt lengths timed alone")
    add("--decode-batches", default="1,4,16", help="decode batch sizes")
    add("--contexts", default="32,128,256", help="context lengths of the decode batches")
    add("--decode-steps", type=int, default=8, help="decode steps per batch")
    add("--repeats", type=int, default=3)
    add("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add("--name", default=None, help="profile name (default: <device>-<model>)")
    add("--out", required=True, help="profile JSON path")


def _measure(args: argparse.Namespace, grid: Grid) -> tuple[ModelSizes, list[StepSample], Any]:
    import torch

    from data_plane.engine.config import EngineConfig
    from data_plane.engine.llm import build_engine
    from data_plane.kv.geometry import KVGeometry
    from data_plane.models import load_model
    from shared.policy import Knobs

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(
        args.model, args.tokenizer, args.dtype, args.device, quantization=args.quantization
    )
    cfg = loaded.config
    geometry = KVGeometry(
        cfg.num_layers, args.block_size, cfg.num_kv_heads, cfg.head_dim, cfg.dtype
    )
    grid = grid.fitted_to(cfg.max_position_embeddings)
    longest = max(max(grid.prefill_tokens), max(grid.contexts)) + grid.num_decode_steps + 1
    num_blocks = max(grid.decode_batches) * (-(-longest // args.block_size) + 1) + 8
    config = EngineConfig(
        block_size=args.block_size,
        num_hbm_blocks=num_blocks,
        max_num_batched_tokens=max(max(grid.prefill_tokens), 2048),
        max_num_seqs=max(max(grid.decode_batches), 1),
        device=args.device,
    )
    engine = build_engine(loaded, config, Knobs(policy="vllm"))
    params = list(loaded.model.parameters())
    sizes = ModelSizes(
        args.name or f"{args.device}-{loaded.name}",
        sum(p.numel() for p in params),
        sum(p.numel() * p.element_size() for p in params),
        geometry.block_bytes // args.block_size,
        args.block_size,
    )
    samples = measure_engine(engine, grid)
    engine.close()
    return sizes, samples, geometry


def run_profile(args: argparse.Namespace) -> int:
    try:
        grid = Grid(
            _ints(args.prefill_tokens),
            _ints(args.decode_batches),
            _ints(args.contexts),
            args.decode_steps,
            args.repeats,
        )
        sizes, samples, geometry = _measure(args, grid)
        fit = fit_step_costs(samples)
        link = measure_link(geometry, args.transfer_backend, args.device)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    how = (
        f"fitted by `superinfer profile` on {platform.node()} ({platform.machine()},"
        f" {args.device}) {date.today().isoformat()}, model {args.model}"
    )
    profile = build_profile(sizes, fit, link, how)
    document = profile_to_dict(profile)
    document["_fit"] = {
        "intercept_s": fit.intercept_s,
        "prefill_token_s": fit.prefill_token_s,
        "context_token_s": fit.context_token_s,
        "r_squared": fit.r_squared,
        "max_rel_error": fit.max_rel_error,
        "samples": [[s.num_prefill_tokens, s.num_decode_seqs, s.num_context_tokens, s.seconds]
                    for s in samples],
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(
        f"profile {profile.name}: step = {1000 * fit.intercept_s:.3f} ms"
        f" + {1e6 * fit.prefill_token_s:.3f} us/prefill token"
        f" + {1e6 * fit.context_token_s:.4f} us/context token"
        f" (R^2 {fit.r_squared:.3f}, {fit.num_samples} steps);"
        f" link {h2d_gbps(link[0])} / {h2d_gbps(link[1])} / {h2d_gbps(link[2])} GB/s"
        f" h2d / d2h / both -> {args.out}"
    )
    return 0


def h2d_gbps(rate: float) -> str:
    return f"{rate / 1e9:.2f}"
