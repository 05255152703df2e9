from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shared.costmodel import (
    CostProfile,
    auto_b_xfer_blocks,
    builtin_profile_names,
    exposed_transfer_s,
    iteration_time_s,
    kv_block_bytes,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    save_profile,
    transfer_time_s,
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
