"""A short request behind a long prompt on a CPU worker, by ``--long-prefill-token-threshold``
(vLLM's cap on one prefill chunk): `superinfer serve` with SmolLM2 (the default model) is
started once per setting, runs alternated (A, B, A, B); each run sends a fresh long prompt
(``--long-tokens``, max_tokens 1), then after 0.5 s a short completion (max_tokens 2), and
times both. Reported per setting: the short request's latency and the long one's (the cost of
smaller chunks), medians over the runs. Ends with a RESULT line.

    .venv/bin/python bench/long_prefill.py [--thresholds 0,256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

PORT = 8731


def _serve(threshold: int, redis_port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SUPERINFER_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"}
    command = [sys.executable, "-m", "superinfer", "serve", "--port", str(PORT)]
    command += ["--long-prefill-token-threshold", str(threshold)]
    process = subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if "SuperInfer ready" in log.read_text(errors="replace"):
            return process
        if process.poll() is not None:
            raise RuntimeError(f"serve exited: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(1)
    process.kill()
    raise RuntimeError("serve was not ready in 300 s")


def _complete(prompt: str, max_tokens: int, out: dict[str, float], key: str) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    t_start = time.perf_counter()
    response = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    out[key] = time.perf_counter() - t_start


def _one_run(long_tokens: int) -> dict[str, float]:
    """A fresh long prompt (no prefix-cache hit), then a short one 0.5 s later."""
    out: dict[str, float] = {}
    words = " ".join(f"w{uuid.uuid4().hex[:4]}" for _ in range(long_tokens // 3))
    long_thread = threading.Thread(target=_complete, args=(words, 1, out, "long_s"))
    long_thread.start()
    time.sleep(0.5)
    _complete(f"Say hi {uuid.uuid4().hex[:6]}.", 2, out, "short_s")
    long_thread.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--thresholds", default="0,256")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--redis-port", type=int, default=6398)
    args = parser.parse_args()
    thresholds = [int(t) for t in args.thresholds.split(",")]
    subprocess.run(
        ["redis-server", "--port", str(args.redis_port), "--daemonize", "yes", "--save", ""],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    results: dict[int, list[dict[str, float]]] = {t: [] for t in thresholds}
    try:
        for round_index in range(args.rounds):
            for threshold in thresholds:
                log = Path(tempfile.mkdtemp()) / "serve.log"
                process = _serve(threshold, args.redis_port, log)
                try:
                    run = _one_run(args.long_tokens)
                finally:
                    process.terminate()
                    process.wait(60)
                load = os.getloadavg()[0]
                print(f"round {round_index} threshold {threshold}: {run} load {load:.2f}")
                results[threshold].append(run)
    finally:
        subprocess.run(["redis-cli", "-p", str(args.redis_port), "shutdown", "nosave"], check=False)
    fields = []
    for threshold, runs in results.items():
        short_s = statistics.median(r["short_s"] for r in runs)
        long_s = statistics.median(r["long_s"] for r in runs)
        print(f"threshold {threshold}: short {short_s:.2f} s, long {long_s:.2f} s (medians)")
        fields += [f"short_s_{threshold}={short_s:.2f}", f"long_s_{threshold}={long_s:.2f}"]
    print("RESULT long_prefill " + " ".join(fields))


if __name__ == "__main__":
    main()
