"""lab.metrics on scripted timelines with answers worked out by hand."""

from __future__ import annotations

import pytest

from lab.metrics import (
    ROW_KEYS,
    RequestTimeline,
    latency_stats_ms,
    meets_tpot,
    meets_ttft,
    percentile,
    run_duration_s,
    slo_fields,
    summarize,
    tbt_gaps_s,
    tpot_s,
    ttft_s,
)

S_F, S_B = 5.0, 0.1


def _tl(
    arrival: float, times: list[float], slo_ttft: float = S_F, slo_tbt: float = S_B
) -> RequestTimeline:
    return RequestTimeline(arrival, times, slo_ttft, slo_tbt)


# a: TTFT 1.0, gaps 0.05 0.05 0.25 (one TBT miss), TPOT 0.35/3 ~ 0.117 > 0.1 -> TPOT miss
# b: TTFT 6.0 (miss), gaps 0.1 0.1 (exactly S_B: met), TPOT 0.1 (met)
# c: TTFT 0.5, one token only: no gap, TPOT vacuous (met)
# d: rejected: no token -> misses TTFT and TPOT
A = _tl(0.0, [1.0, 1.05, 1.1, 1.35])
B = _tl(1.0, [7.0, 7.1, 7.2])
C = _tl(2.0, [2.5])
D = _tl(3.0, [])


def test_per_request_quantities() -> None:
    assert ttft_s(A) == pytest.approx(1.0)
    assert ttft_s(D) is None
    assert tbt_gaps_s(A) == pytest.approx([0.05, 0.05, 0.25])
    assert tbt_gaps_s(C) == []
    assert tpot_s(A) == pytest.approx(0.35 / 3)
    assert tpot_s(C) is None
    assert [meets_ttft(t) for t in (A, B, C, D)] == [True, False, True, False]
    assert [meets_tpot(t) for t in (A, B, C, D)] == [False, True, True, False]


def test_summary_known_answers() -> None:
    s = summarize([A, B, C, D])
    assert s.num_requests == 4 and s.num_served == 3
    assert s.ttft_attainment == pytest.approx(2 / 4)
    assert s.tpot_attainment == pytest.approx(2 / 4)
    # gaps: 0.05 0.05 0.25 | 0.1 0.1 -> 4 of 5 within 0.1 s (0.1 itself counts)
    assert s.tbt_attainment == pytest.approx(4 / 5)
    assert s.slo_attainment == pytest.approx(1 / 4)  # only c meets both TTFT and TPOT
    # run: first arrival 0.0 to last token 7.2
    assert s.duration_s == pytest.approx(7.2)
    assert s.num_output_tokens == 8
    assert s.output_tokens_per_s == pytest.approx(8 / 7.2)
    # good = meets TTFT and TPOT: only C
    assert s.goodput_rps == pytest.approx(1 / 7.2)
    # TTFTs 1.0, 6.0, 0.5 -> median 1.0; p99 by linear interpolation: 1.0 + 0.98 * 5.0
    assert s.ttft_p50_s == pytest.approx(1.0)
    assert s.ttft_p99_s == pytest.approx(5.9)
    # gaps sorted 0.05 0.05 0.1 0.1 0.25 -> median 0.1
    assert s.tbt_p50_s == pytest.approx(0.1)


def test_gaps_do_not_cross_requests() -> None:
    # Two requests far apart in time: the jump between them is not a gap.
    s = summarize([_tl(0.0, [0.1, 0.15]), _tl(100.0, [100.2, 100.25])])
    assert s.tbt_attainment == 1.0
    assert s.tbt_p99_s == pytest.approx(0.05)


def test_per_request_slo_classes() -> None:
    # The same gaps pass a loose S_B and fail a tight one.
    loose, tight = _tl(0.0, [0.1, 0.3], slo_tbt=0.5), _tl(0.0, [0.1, 0.3], slo_tbt=0.1)
    assert summarize([loose, tight]).tbt_attainment == pytest.approx(0.5)
    assert meets_tpot(loose) and not meets_tpot(tight)


def test_empty_and_explicit_duration() -> None:
    s = summarize([])
    assert s.num_requests == 0 and s.ttft_p50_s is None and s.goodput_rps == 0.0
    assert summarize([D]).ttft_attainment == 0.0
    assert summarize([C], duration_s=10.0).goodput_rps == pytest.approx(0.1)
    assert run_duration_s([D]) == 0.0
    with pytest.raises(ValueError, match="duration_s"):
        summarize([C], duration_s=-1.0)


def test_unfinished_requests_miss_tpot_and_goodput() -> None:
    cut = RequestTimeline(0.0, [0.5, 0.55, 0.6], S_F, S_B, finished=False)
    assert meets_ttft(cut) and not meets_tpot(cut)
    s = summarize([cut, C])
    assert s.num_unfinished == 1 and s.tpot_attainment == 0.5 and s.tbt_attainment == 1.0
    assert s.goodput_rps == pytest.approx(1 / 2.5)


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 25) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_slo_fields_are_the_row_keys_slo_part() -> None:
    fields = slo_fields(summarize([A, B, C, D]))
    start = ROW_KEYS.index("ttft_attainment")
    assert tuple(fields) == ROW_KEYS[start : start + len(fields)]
    assert fields["ttft_attainment"] == pytest.approx(0.5)


def test_latency_stats_in_vllm_names() -> None:
    stats = latency_stats_ms("ttft", [0.5, 1.0, 2.0])
    assert stats["mean_ttft_ms"] == pytest.approx(3500 / 3)
    assert stats["median_ttft_ms"] == pytest.approx(1000)
    assert stats["p99_ttft_ms"] == pytest.approx(1980)
    assert stats["std_ttft_ms"] == pytest.approx(623.6095, rel=1e-6)
    assert latency_stats_ms("itl", []) == dict.fromkeys(
        ("mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms")
    )


def test_vllms_metric_percentiles_by_hand() -> None:
    """1..100 ms: linear interpolation between closest ranks (numpy's and vLLM's)."""
    stats = latency_stats_ms("ttft", [i / 1000 for i in range(1, 101)], (50, 90, 99.9))
    assert stats["p50_ttft_ms"] == pytest.approx(50.5)  # rank 49.5
    assert stats["p90_ttft_ms"] == pytest.approx(90.1)  # rank 89.1
    assert stats["p99.9_ttft_ms"] == pytest.approx(99.901)  # rank 98.901
    assert stats["p99_ttft_ms"] == pytest.approx(99.01)  # always there (the table shows it)
    assert latency_stats_ms("itl", [], (50,))["p50_itl_ms"] is None
