"""vllm vs lvf for real on the GPU: the engine serving a ShareGPT-stats trace in real time.

The engine (``data_plane.engine.engine.Engine``, its KV managers, DuplexKV on the ``cuda``
transfer backend, the policies of ``shared.policy``) runs a Llama-3-8B-shaped random model
(bf16) on the GPU data path (Triton paged attention, CUDA graphs for decode batches). KV
budget that forces contention: 8 GiB of HBM (4,096 blocks of 16 tokens); lvf also gets a
16 GiB pinned DRAM tier (vllm runs HBM-only, as vLLM V1 has no host tier, like the simulator).
B_xfer is ``auto``: after every iteration, what one direction of the H200 profile's link moves
in the iteration just measured. Requests arrive at their trace times (ShareGPT length stats,
Poisson arrivals, lengths clipped to 6,144 + 1,024 tokens, greedy, EOS ignored); a run ends
``--drain`` seconds after the last arrival, unfinished requests count as misses
(``lab.metrics``). The simulator's prediction for the same setup is printed beside each row
(the h200-llama3-8b profile; it is not this engine's fitted profile).

Chosen with the simulator: at 3 req/s the HBM pool binds for vllm (predicted TTFT attainment
0.72 with a 6 GiB pool, 1.0 with 8 GiB) and at 5 req/s it is overloaded (vllm 0.21, lvf 0.80).

Writes ``$OUT/policy_e2e.json`` (``bench/out/`` without ``OUT``); last line
``RESULT policy_e2e`` with, per rate R, ``ttft_<policy>_rR``, ``tbt_<policy>_rR``
(attainment) and ``tput_ratio_rR`` (lvf / vllm output tokens per second). ``--budget-s``
drops the last rates that would not fit.

    python bench/gpu/policy_e2e.py [--rates 3,5] [--duration 60] [--budget-s 280]
    python bench/gpu/policy_e2e.py --device cpu --tiny --trace synthetic:32:8 --rates 4 \\
        --duration 3 --hbm-kv-gib 0.001 --dram-kv-gib 0.004     # smoke run on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.gpu.model_shapes import LLAMA3_8B, TINY, build_model  # noqa: E402
from data_plane.engine.engine import Engine  # noqa: E402
from data_plane.engine.executor import BatchItem, Executor, Sampled  # noqa: E402
from data_plane.engine.model_runner import ModelRunner  # noqa: E402
from data_plane.engine.request import RequestError  # noqa: E402
from data_plane.engine.sampling import SamplingParams  # noqa: E402
from data_plane.kv.geometry import KVGeometry  # noqa: E402
from data_plane.kv.host_pool import allocate_host_pool, cuda_host_register  # noqa: E402
from data_plane.kv.tiered import KVCacheManager  # noqa: E402
from data_plane.transfer import make_transfer_engine  # noqa: E402
from lab.costmodel import auto_b_xfer_blocks, load_profile  # noqa: E402
from lab.metrics import RequestTimeline, slo_fields, summarize  # noqa: E402
from lab.traces import TraceRequest, load_trace  # noqa: E402
from shared.policy import Knobs, make_plan  # noqa: E402

SHAREGPT = "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
BLOCK_SIZE = 16
GIB = 1 << 30
RUN_OVERHEAD_S = 3.0  # engine build, drain and close around each run


class _Executor(Executor):
    def __init__(self, runner: ModelRunner, kv: torch.Tensor) -> None:
        self.runner, self.kv = runner, kv

    def execute(self, items: list[BatchItem]) -> Sampled:
        return self.runner.execute(items, self.kv)


class Pools:
    """The model, its runner and the KV pools, built once and shared by every run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.device = args.device
        self.model, config = build_model(TINY if args.tiny else LLAMA3_8B, args.device)
        self.geometry = KVGeometry(
            config.num_layers, BLOCK_SIZE, config.num_kv_heads, config.head_dim, config.dtype
        )
        self.num_hbm = self.geometry.blocks_in(args.hbm_kv_gib)
        self.num_dram = self.geometry.blocks_in(args.dram_kv_gib)
        self.max_model_len = config.max_position_embeddings
        self.hbm = self.geometry.allocate(self.num_hbm, args.device)
        if args.device == "cuda":  # registered once for every run (2.6 GB/s on the H200 host)
            self.dram = allocate_host_pool(self.num_dram, self.geometry.block_shape, config.dtype)
            element = self.dram.element_size()
            cuda_host_register(self.dram.data_ptr(), self.dram.numel() * element)
        else:
            self.dram = self.geometry.allocate(self.num_dram, "cpu")
        self.runner = ModelRunner(self.model, BLOCK_SIZE, args.device)
        if self.runner.graphs is not None:
            self.runner.graphs.capture_all(self.hbm, max_batch=args.max_num_seqs)
        self.profile = load_profile("h200-llama3-8b")

    def engine(self, policy: str, args: argparse.Namespace) -> Engine:
        knobs = Knobs(policy=policy, slo_ttft_s=args.slo_ttft, slo_tbt_s=args.slo_tbt, b_xfer=None)
        kv: KVCacheManager
        if policy == "vllm" or self.num_dram == 0:
            kv = KVCacheManager.hbm_only(self.num_hbm, BLOCK_SIZE)
        else:
            backend = "cuda" if self.device == "cuda" else "cpu"
            transfer = make_transfer_engine(backend, self.hbm, self.dram)
            first = auto_b_xfer_blocks(self.profile, 0.03, self.geometry.block_bytes)
            kv = KVCacheManager(
                self.num_hbm, self.num_dram, BLOCK_SIZE, transfer, b_xfer_blocks=first
            )
        return Engine(
            executor=_Executor(self.runner, self.hbm),
            kv=kv,
            planner=lambda snapshot: make_plan(snapshot, knobs),
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len,
        )


def replay(pools: Pools, engine: Engine, trace: list[TraceRequest], horizon_s: float) -> dict:
    """Serve ``trace`` in real time until ``horizon_s`` after its start; returns the token
    times of every request and the counters."""
    vocab = pools.model.config.vocab_size
    times: list[list[float]] = [[] for _ in trace]
    rejected = 0
    t0 = time.monotonic()
    nxt = 0
    while True:
        now = time.monotonic() - t0
        while nxt < len(trace) and trace[nxt].arrival_s <= now:
            request = trace[nxt]
            prompt = [(7 * nxt + i) % (vocab - 3) + 3 for i in range(request.input_len)]
            params = SamplingParams(max_tokens=request.output_len, temperature=0, ignore_eos=True)
            try:
                engine.add_request(f"r{nxt}", prompt, params, t_arr_s=t0 + request.arrival_s)
            except RequestError:
                rejected += 1
            nxt += 1
        if now >= horizon_s or (nxt == len(trace) and not engine.has_unfinished()):
            break
        if not engine.has_unfinished():
            time.sleep(min(0.005, max(0.0, trace[nxt].arrival_s - now)))
            continue
        t_step = time.perf_counter()
        outputs = engine.step().outputs
        stamp = time.monotonic() - t0
        if engine.kv.has_dram:  # B_xfer auto, as the simulator does
            step_s = time.perf_counter() - t_step
            block_bytes = pools.geometry.block_bytes
            engine.kv.b_xfer_blocks = auto_b_xfer_blocks(pools.profile, step_s, block_bytes)
        for out in outputs:
            times[int(out.request_id[1:])].extend([stamp] * len(out.new_token_ids))
    unfinished = {int(rid[1:]) for rid in engine.requests} | set(range(nxt, len(trace)))
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return {"times": times, "unfinished": unfinished, "rejected": rejected}


def run_one(
    pools: Pools, policy: str, rate: float, trace: list[TraceRequest], args: argparse.Namespace
) -> dict[str, Any]:
    engine = pools.engine(policy, args)
    result = replay(pools, engine, trace, args.duration + args.drain)
    stats, kv = engine.stats, engine.kv
    row: dict[str, Any] = {"policy": policy, "rps": rate, "num_requests": len(trace)}
    timelines = [
        RequestTimeline(r.arrival_s, t, args.slo_ttft, args.slo_tbt, i not in result["unfinished"])
        for i, (r, t) in enumerate(zip(trace, result["times"], strict=True))
    ]
    row.update(slo_fields(summarize(timelines)))
    row.update(
        unfinished=len(result["unfinished"]),
        rejected=result["rejected"],
        preemptions=stats.num_preemptions,
        rotations=stats.num_rotations_out,
        iterations=stats.num_iterations,
        mean_step_ms=1e3 * stats.step_time_s / max(1, stats.num_iterations),
        model_share=stats.model_time_s / max(1e-9, stats.step_time_s),
    )
    if kv.has_dram:
        kv.drain()
    stats = kv.stats()  # drained: every block still held is leaked
    if kv.has_dram:
        row.update(
            bytes_h2d=kv.transfer.stats.bytes_h2d,
            bytes_d2h=kv.transfer.stats.bytes_d2h,
            exposed_transfer_s=kv.tiered_stats.exposed_transfer_s,
            leaked_dram_blocks=stats.num_dram_blocks - stats.num_free_dram_blocks,
        )
    row["leaked_hbm_blocks"] = stats.num_hbm_blocks - stats.num_free_hbm_blocks
    engine.close()
    return row


def simulated(
    policy: str, rate: float, trace: list[TraceRequest], args: argparse.Namespace
) -> dict[str, Any]:
    """The simulator's row for the same trace, pools and SLOs (h200-llama3-8b profile)."""
    from lab.sim.setup import SimSetup
    from lab.sim.simulator import run_simulation

    setup = SimSetup(load_profile("h200-llama3-8b"), args.hbm_kv_gib, args.dram_kv_gib, "auto",
                     args.max_num_batched_tokens, args.max_num_seqs)  # fmt: skip
    knobs = Knobs(policy=policy, slo_ttft_s=args.slo_ttft, slo_tbt_s=args.slo_tbt)
    result = run_simulation(trace, policy, knobs, setup, rps=rate,
                            horizon_s=args.duration + args.drain)  # fmt: skip
    keys = ("ttft_attainment", "tbt_attainment", "output_tokens_per_s", "preemptions")
    return {f"sim_{k}": result.row[k] for k in keys}


def trace_path(spec: str | None) -> str:
    if spec:
        return spec
    kit = Path(os.environ.get("SUPERINFER_KIT", ROOT.parent / "shared"))
    return str(kit / "traces" / SHAREGPT)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=None, help=f"default: $SUPERINFER_KIT/traces/{SHAREGPT}")
    p.add_argument("--rates", default="3,5")
    p.add_argument("--policies", default="vllm,lvf")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--drain", type=float, default=5.0, help="seconds served after them")
    p.add_argument("--hbm-kv-gib", type=float, default=8.0)
    p.add_argument("--dram-kv-gib", type=float, default=16.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-input-len", type=int, default=6144)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--slo-ttft", type=float, default=5.0)
    p.add_argument("--slo-tbt", type=float, default=0.1)
    p.add_argument("--budget-s", type=float, default=None, help="wall budget of this script")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator's prediction")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    return p.parse_args()


def main() -> int:
    started = time.monotonic()
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("policy_e2e: needs a CUDA device (or --device cpu --tiny)", file=sys.stderr)
        return 2
    rates = [float(r) for r in args.rates.split(",")]
    policies = args.policies.split(",")
    pools = Pools(args)
    print(f"{pools.num_hbm} HBM blocks, {pools.num_dram} DRAM blocks", flush=True)
    warm_up(pools, args)
    print(f"setup and warm-up {time.monotonic() - started:.1f} s", flush=True)
    rows: list[dict[str, Any]] = []
    per_rate_s = len(policies) * (args.duration + args.drain + RUN_OVERHEAD_S)
    for rate in rates:
        if args.budget_s is not None and time.monotonic() - started + per_rate_s > args.budget_s:
            print(f"rate {rate}: skipped, it would not fit the {args.budget_s:.0f} s budget")
            continue
        trace = load_trace(trace_path(args.trace), rps=rate, duration_s=args.duration,
                           num_requests=None, seed=0, max_input_len=args.max_input_len,
                           max_output_len=args.max_output_len)  # fmt: skip
        for policy in policies:
            rows.append(run_one(pools, policy, rate, trace, args))
            print(json.dumps(rows[-1]), flush=True)
            write_rows(rows, args)
        print(result_line(rows), flush=True)  # after every rate: a timeout keeps the last
    if not args.no_sim:  # after the RESULT line: a timeout here loses nothing measured
        add_predictions(rows, args)
        write_rows(rows, args)
    return 0 if rows else 1


def warm_up(pools: Pools, args: argparse.Namespace) -> None:
    """Compile every kernel variant and capture before the clock runs: prompts longer than a
    chunk (prefill after cached tokens), decodes, and rotation through the DRAM tier."""
    engine = pools.engine("lvf" if pools.num_dram else "vllm", args)
    lengths = [args.max_num_batched_tokens + 37, 300, 5, 64]
    for index, length in enumerate(lengths):
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        engine.add_request(f"w{index}", [3 + index] * min(length, pools.max_model_len - 9), params)
    while engine.has_unfinished():
        engine.step()
    engine.close()


def write_rows(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    out = Path(os.environ.get("OUT", "bench/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "policy_e2e.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


def add_predictions(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    for row in rows:
        try:
            trace = load_trace(trace_path(args.trace), rps=row["rps"], duration_s=args.duration,
                               num_requests=None, seed=0, max_input_len=args.max_input_len,
                               max_output_len=args.max_output_len)  # fmt: skip
            row.update(simulated(row["policy"], row["rps"], trace, args))
        except Exception as exc:  # the measured rows stand without the prediction
            row["sim_error"] = f"{type(exc).__name__}: {exc}"[:200]
        print(row["policy"], row["rps"], {k: v for k, v in row.items() if k.startswith("sim")})


def result_line(rows: list[dict[str, Any]]) -> str:
    parts = ["RESULT policy_e2e"]
    by_key = {(row["policy"], row["rps"]): row for row in rows}
    for rps in sorted({row["rps"] for row in rows}):
        tag = f"r{rps:g}"
        for policy in ("vllm", "lvf"):
            row = by_key.get((policy, rps))
            if row is not None:
                parts.append(f"ttft_{policy}_{tag}={row['ttft_attainment']:.3f}")
                parts.append(f"tbt_{policy}_{tag}={row['tbt_attainment']:.3f}")
        base, ours = by_key.get(("vllm", rps)), by_key.get(("lvf", rps))
        if base and ours and base["output_tokens_per_s"]:
            ratio = ours["output_tokens_per_s"] / base["output_tokens_per_s"]
            parts.append(f"tput_ratio_{tag}={ratio:.3f}")
    return " ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
