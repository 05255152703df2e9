"""lab/sessions.py and the simulator's prompts: conversations grow turn by turn and share the
system prompt; Mooncake's hash_ids become shared prefixes; the simulator models the prefix
caches for every policy (vllm's in HBM, lvf's in HBM and DRAM)."""

from __future__ import annotations

import itertools

import pytest

from lab.costmodel import load_profile
from lab.sessions import conversations
from lab.sim.setup import SimSetup
from lab.sim.simulator import prompt_tokens, run_simulation
from lab.traces import TraceRequest
from shared.policy import Knobs


def _base(num: int) -> list[TraceRequest]:
    return [TraceRequest(0.5 * i, 100 + i, 20) for i in range(num)]


def test_turns_extend_the_conversation_and_arrive_after_the_answer() -> None:
    turns = conversations(_base(6), turns=3, think_s=2.0, system_len=64, seed=1)
    first = sorted((r for r in turns if r.session == 0), key=lambda r: r.arrival_s)
    assert [r.input_len for r in first] == [64 + 100, 64 + 100 + 20 + 101, 285 + 20 + 102]
    assert all(b.arrival_s > a.arrival_s + 20 * 0.03 for a, b in itertools.pairwise(first))
    assert len(turns) == 6 and {r.session for r in turns} == {0, 1}
    assert [r.arrival_s for r in turns] == sorted(r.arrival_s for r in turns)
    capped = conversations(_base(6), turns=6, max_prompt_len=300)
    assert max(r.input_len for r in capped) == 300
    with pytest.raises(ValueError):
        conversations(_base(2), turns=0)


def test_prompts_share_exactly_what_the_trace_says() -> None:
    turns = conversations(_base(4), turns=2, system_len=64)
    a0, a1 = (r for r in turns if r.session == 0)
    b0 = next(r for r in turns if r.session == 1)
    t_a0, t_a1, t_b0 = (prompt_tokens(i, r, r.input_len) for i, r in enumerate((a0, a1, b0)))
    assert t_a1[: len(t_a0)] == t_a0  # the next turn extends the previous prompt
    assert t_b0[:64] == t_a0[:64] and t_b0[64] != t_a0[64]  # only the system prompt is shared
    x = TraceRequest(0.0, 1000, 5, hash_ids=(7, 8))
    y = TraceRequest(1.0, 1000, 5, hash_ids=(7, 9))
    t_x, t_y = prompt_tokens(0, x, 1000), prompt_tokens(1, y, 1000)
    assert t_x[:512] == t_y[:512] and t_x[512] != t_y[512]
    plain = [prompt_tokens(i, TraceRequest(0.0, 50, 5), 50) for i in range(2)]
    assert not set(plain[0]) & set(plain[1])  # no hash ids, no session: nothing shared


@pytest.mark.parametrize("policy", ["vllm", "lvf"])
def test_the_simulator_models_the_caches(policy: str) -> None:
    """A session's later turns hit what its earlier turns computed; off, nothing hits."""
    trace = conversations(_base(12), turns=3, think_s=0.5, system_len=256)
    rows = {}
    for caching in ("off", "hbm", "both"):
        setup = SimSetup(load_profile("h200-llama3-8b"), 1.0, 8.0, prefix_caching=caching)
        rows[caching] = run_simulation(trace, policy, Knobs(), setup, horizon_s=200).prefix
    assert rows["off"]["prefix_hbm_hit_frac"] == 0 == rows["off"]["prefix_dram_hit_frac"]
    assert rows["hbm"]["prefix_hbm_hit_frac"] > 0.3
    saved = {k: r["prefix_hbm_hit_frac"] + r["prefix_dram_hit_frac"] for k, r in rows.items()}
    assert saved["both"] >= saved["hbm"] - 1e-9
    if policy == "vllm":  # no DRAM tier: "both" is the HBM cache
        assert rows["both"]["prefix_dram_hit_frac"] == 0
