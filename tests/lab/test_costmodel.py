from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lab.costmodel import (
    CostProfile,
    auto_b_xfer_blocks,
    builtin_profile_names,
    copy_interference_s,
    exposed_transfer_s,
    iteration_time_s,
    kv_block_bytes,
    load_profile,
    plan_time_s,
    prefill_attention_pairs,
    profile_from_dict,
    profile_to_dict,
    save_profile,
    transfer_time_s,
    with_link_scale,
)


def _toy(**changes: object) -> CostProfile:
    base = CostProfile(
        name="toy",
        source="hand-made numbers",
        fixed_overhead_s=0.001,
        weight_bytes=1e9,
        hbm_bandwidth_bytes_s=1e12,
        flops_per_token=1e9,
        peak_flops=1e14,
        kv_bytes_per_token=1000,
        link_h2d_bytes_s=50e9,
        link_d2h_bytes_s=40e9,
        duplex=True,
        link_duplex_bytes_s=60e9,
        block_size_tokens=16,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_iteration_time_hand_computed() -> None:
    p = _toy()
    # 1 ms fixed + 1 ms weights + 100 * 1e9 / 1e14 = 1 ms prefill + 2e6 * 1000 / 1e12 = 2 ms KV
    assert iteration_time_s(p, 100, 3, 2_000_000) == pytest.approx(0.005)
    assert iteration_time_s(p, 0, 1, 0) == pytest.approx(0.002)
    assert iteration_time_s(p, 0, 0, 0) == 0.0
    with pytest.raises(ValueError, match="num_context_tokens"):
        iteration_time_s(p, 0, 1, -1)
    # a fitted per-token rate replaces flops / peak; attention pairs at their own rate
    fitted = _toy(prefill_s_per_token=2e-5, attention_s_per_pair=1e-9)
    # 1 + 1 + 100 x 0.02 + 2 (KV) ms + 1e6 pairs x 1e-9 s = 1 ms
    assert iteration_time_s(fitted, 100, 3, 2_000_000, 1_000_000) == pytest.approx(0.007)
    with pytest.raises(ValueError, match="num_attention_pairs"):
        iteration_time_s(fitted, 1, 0, 1, -1)


def test_transfer_time_duplex_and_serial() -> None:
    p = _toy()
    # one direction alone: its own rate
    assert transfer_time_s(p, 50e9, 0) == pytest.approx(1.0)
    assert transfer_time_s(p, 0, 40e9) == pytest.approx(1.0)
    # both at once: max(1 s, 1 s) = 1 s, but the 60 GB/s aggregate bounds it: 90e9 / 60e9
    assert transfer_time_s(p, 50e9, 40e9) == pytest.approx(1.5)
    # small second direction: the slow direction dominates
    assert transfer_time_s(p, 50e9, 1e9) == pytest.approx(max(1.0, 51e9 / 60e9))
    # no duplex: the directions take turns
    assert transfer_time_s(_toy(duplex=False), 50e9, 40e9) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        transfer_time_s(p, -1, 0)


def test_link_scale_speeds_up_the_copies_only() -> None:
    p = _toy()
    fast = with_link_scale(p, 10.0)
    # the same bytes, both ways at once: 1.5 s at the toy's rates (above), a tenth now
    assert transfer_time_s(fast, 50e9, 40e9) == pytest.approx(0.15)
    assert transfer_time_s(fast, 50e9, 0) == pytest.approx(0.1)
    assert iteration_time_s(fast, 64, 8, 8 * 1024) == iteration_time_s(p, 64, 8, 8 * 1024)
    assert fast.name == "toy (link x10)" and with_link_scale(p, 1.0) is p
    for bad in (0.0, -2.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="link scale"):
            with_link_scale(p, bad)


def test_exposed_transfer() -> None:
    assert exposed_transfer_s(0.070, 0.016) == 0.0
    assert exposed_transfer_s(0.010, 0.016) == pytest.approx(0.006)
    with pytest.raises(ValueError):
        exposed_transfer_s(-1.0, 0.0)


def test_auto_b_xfer_blocks() -> None:
    p = _toy()
    # slower direction 40 GB/s x 0.1 s / 1 MB blocks = 4000
    assert auto_b_xfer_blocks(p, 0.1, 1_000_000) == 4000
    assert auto_b_xfer_blocks(p, 0.1, 1_500_000) == 2666  # floor
    assert auto_b_xfer_blocks(p, 0.0, 1_000_000) == 1  # at least one block
    with pytest.raises(ValueError):
        auto_b_xfer_blocks(p, 0.1, 0)


def test_builtin_profiles_load_with_sources() -> None:
    names = builtin_profile_names()
    assert {"h200-llama3-8b", "gh200-llama3-8b"} <= set(names)
    for name in names:
        p = load_profile(name)
        assert p.name == name
        assert kv_block_bytes(p) == 2 * 1024 * 1024
        documented = set(p.sources)
        assert {f.name for f in dataclasses.fields(CostProfile)} - {
            "name",
            "source",
            "sources",
        } <= (documented)


def test_h200_profile_against_anchors() -> None:
    p = load_profile("h200-llama3-8b")
    # the fixed overhead was derived from the batch-1 CUDA-graph anchor, so that point is exact
    assert iteration_time_s(p, 0, 1, 1024) == pytest.approx(8.204e-3, rel=1e-3)
    b64_s = iteration_time_s(p, 0, 64, 64 * 1024)
    assert 5.7e-3 < b64_s < 52.8e-3  # between the roofline and transformers' graph step
    assert 2 * 1024 * 1024 * 25 / transfer_time_s(p, 2 * 1024 * 1024 * 25, 0) == pytest.approx(
        51.4e9
    )


def test_profile_round_trip(tmp_path: Path) -> None:
    p = dataclasses.replace(load_profile("h200-llama3-8b"), name="fitted", fixed_overhead_s=0.003)
    path = tmp_path / "fitted.json"
    save_profile(p, path)
    again = load_profile(path)
    assert again == p
    assert again.sources == p.sources
    assert profile_from_dict(profile_to_dict(p)) == p
    assert json.loads(path.read_text())["_sources"]["peak_flops"]


def test_unknown_profile_lists_builtins() -> None:
    with pytest.raises(ValueError, match="h200-llama3-8b"):
        load_profile("a100-nonexistent")


def test_bad_profile_dicts() -> None:
    data = profile_to_dict(_toy())
    with pytest.raises(ValueError, match="unknown cost profile fields"):
        profile_from_dict({**data, "hbm_bw": 1.0})
    missing = {k: v for k, v in data.items() if k != "peak_flops"}
    with pytest.raises(ValueError, match="peak_flops"):
        profile_from_dict(missing)
    with pytest.raises(ValueError, match="hbm_bandwidth_bytes_s must be > 0"):
        _toy(hbm_bandwidth_bytes_s=0.0)


# ANCHORS.md / h200_llama8b_cost_2026-11-29.json: transformers eager prefill of one sequence
PREFILL_ANCHORS_MS = {2048: 59.921, 4096: 118.673, 8192: 247.252}


def _prefill_s(profile: CostProfile, num_tokens: int) -> float:
    pairs = prefill_attention_pairs(0, num_tokens)
    return iteration_time_s(profile, num_tokens, 0, num_tokens, pairs)


@pytest.mark.parametrize("name", ["h200-llama3-8b", "gh200-llama3-8b"])
def test_prefill_cost_matches_the_h200_anchors(name: str) -> None:
    p = load_profile(name)
    for num_tokens, ms in PREFILL_ANCHORS_MS.items():
        assert _prefill_s(p, num_tokens) == pytest.approx(ms * 1e-3, rel=0.05), num_tokens
    # attention makes prefill superlinear: doubling 4096 tokens more than doubles the time
    assert _prefill_s(p, 8192) - _prefill_s(p, 4096) > 2.05 * (
        _prefill_s(p, 4096) - _prefill_s(p, 2048)
    )
    # the decode anchor still holds (decode keeps its memory-bound model)
    assert iteration_time_s(p, 0, 1, 1024) < 8.3e-3


def test_prefill_attention_pairs() -> None:
    assert prefill_attention_pairs(0, 1) == 1
    assert prefill_attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert prefill_attention_pairs(100, 4) == 101 + 102 + 103 + 104
    # chunked prefill attends to the same pairs as the whole prompt at once
    whole = prefill_attention_pairs(0, 3000)
    assert prefill_attention_pairs(0, 1000) + prefill_attention_pairs(1000, 2000) == whole


def test_copy_interference() -> None:
    p = _toy(copy_compute_overlap_efficiency=0.9)
    # copies as long as the compute: both take compute / 0.9 (ANCHORS.md's definition)
    assert 0.05 + copy_interference_s(p, 0.05, 0.05) == pytest.approx(0.05 / 0.9)
    assert copy_interference_s(p, 0.05, 0.01) == pytest.approx(0.01 / 9)
    assert copy_interference_s(p, 0.05, 1.0) == copy_interference_s(p, 0.05, 0.05)
    assert copy_interference_s(p, 0.05, 0.0) == 0.0
    assert copy_interference_s(_toy(), 0.05, 0.05) == 0.0  # default 1.0: no interference
    assert load_profile("h200-llama3-8b").copy_compute_overlap_efficiency == 0.9
    with pytest.raises(ValueError):
        copy_interference_s(p, -1.0, 0.0)


def test_plan_time() -> None:
    p = _toy(plan_fixed_s=4e-4, plan_per_request_s=2e-7)
    assert plan_time_s(p, 0) == pytest.approx(4e-4)
    assert plan_time_s(p, 4096) == pytest.approx(4e-4 + 4096 * 2e-7)
    assert plan_time_s(_toy(), 4096) == 0.0
    h200 = load_profile("h200-llama3-8b")
    assert 1e-4 < plan_time_s(h200, 256) < plan_time_s(h200, 4096) < 1e-2


def test_old_profile_without_the_new_fields_loads() -> None:
    new = {"prefill_s_per_token", "attention_s_per_pair", "copy_compute_overlap_efficiency"}
    new |= {"plan_fixed_s", "plan_per_request_s"}
    data = profile_to_dict(load_profile("h200-llama3-8b"))
    old = {k: v for k, v in data.items() if k not in new}
    old["_sources"] = {k: v for k, v in data["_sources"].items() if k not in new}
    p = profile_from_dict(old)
    assert (p.prefill_s_per_token, p.attention_s_per_pair) == (None, 0.0)
    assert (p.copy_compute_overlap_efficiency, p.plan_fixed_s, p.plan_per_request_s) == (1, 0, 0)
    # the old model: prefill tokens at flops_per_token / peak_flops, no attention term
    expected = iteration_time_s(p, 0, 1, 0) + 100 * p.flops_per_token / p.peak_flops
    assert iteration_time_s(p, 100, 1, 0, 5050) == pytest.approx(expected)


def test_new_fields_are_validated() -> None:
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="copy_compute_overlap_efficiency"):
            _toy(copy_compute_overlap_efficiency=bad)
    with pytest.raises(ValueError, match="prefill_s_per_token"):
        _toy(prefill_s_per_token=0.0)
    for name in ("attention_s_per_pair", "plan_fixed_s", "plan_per_request_s"):
        with pytest.raises(ValueError, match=name):
            _toy(**{name: -1e-9})
