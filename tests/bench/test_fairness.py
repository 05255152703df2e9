"""bench/fairness.py's measures on hand-made runs with answers worked out by hand, and a
short end-to-end run of the bench (its shape, not its figures)."""

from __future__ import annotations

import re

import pytest

from bench import fairness as fb
from bench.fairness_measure import (
    TenantRun,
    jain,
    light_attainment,
    light_entitlement,
    max_min_shares,
    tenant_shares,
    window_service,
)
from lab.metrics import RequestTimeline
from lab.traces import TraceRequest


def test_max_min_shares_water_fill() -> None:
    # 90 to share: a asks 10 (gets it), b 20 (gets it), c and d split the 60 left
    shares = max_min_shares({"a": 10.0, "b": 20.0, "c": 100.0, "d": 50.0}, 90.0)
    assert shares == pytest.approx({"a": 10.0, "b": 20.0, "c": 30.0, "d": 30.0})
    assert max_min_shares({"a": 5.0, "b": 5.0}, 100.0) == {"a": 5.0, "b": 5.0}


def test_jain() -> None:
    assert jain([1.0, 1.0, 1.0]) == 1.0
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain([2.0, 1.0]) == pytest.approx(9 / 10)
    assert jain([]) == 1.0


def _timeline(arrival: float, times: list[float]) -> RequestTimeline:
    return RequestTimeline(arrival, times, slo_ttft_s=1.0, slo_tbt_s=0.5)


def test_window_service_and_shares() -> None:
    r = TraceRequest(0.0, 100, 3)
    assert window_service(r, _timeline(0.0, [1.0, 2.0, 12.0]), 10.0) == 102.0
    assert window_service(r, _timeline(0.0, [11.0]), 10.0) == 0.0  # first token after the end
    trace = [
        TraceRequest(0.0, 100, 2, tenant="heavy"),
        TraceRequest(1.0, 100, 2, tenant="heavy"),
        TraceRequest(2.0, 10, 2, tenant="t1"),
    ]
    timelines = [_timeline(0.0, [0.5, 1.0]), _timeline(1.0, [1.5, 2.0]), _timeline(2.0, [9.0, 9.5])]
    run = TenantRun.of("x", trace, timelines, {"goodput_rps": 1.0}, 10.0)
    assert run.service == {"heavy": 204.0, "t1": 12.0}
    assert run.demand == {"heavy": 204.0, "t1": 12.0}
    assert run.attainment("heavy") == 1.0 and run.attainment("t1") == 0.0  # TTFT 7 s > 1 s
    assert light_attainment(run) == 0.0 and run.goodput("heavy") == pytest.approx(0.2)
    # total 216: t1 asks 12 (gets it), heavy the 204 left; both got their share
    assert tenant_shares(run) == pytest.approx([1.0, 1.0])
    alone = TenantRun.of("a", trace[2:], timelines[2:], {"goodput_rps": 1.0}, 10.0)
    assert tenant_shares(run, alone) == pytest.approx([1.0, 1.0])


def test_light_entitlement_is_the_fair_share_of_what_they_got_alone() -> None:
    trace = [TraceRequest(0.0, 98, 2, tenant=t) for t in ("heavy", "heavy", "t1", "t2")]
    served = [_timeline(0.0, [0.5, 1.0])] * 4  # 100 tokens each: heavy 200, t1 100, t2 100
    run = TenantRun.of("fair", trace, served, {"goodput_rps": 1.0}, 10.0)
    alone = TenantRun.of("alone", trace[2:], served[2:], {"goodput_rps": 1.0}, 10.0)
    assert light_entitlement(run, alone) == 1.0  # 400 shared: t1, t2 get their 100 each
    # the same demands, 240 served in all: 80 each, so t1 and t2 are entitled to 160 of 200
    slow = [_timeline(0.0, [0.5, 11.0])] * 3 + [_timeline(0.0, [11.0])]
    short = TenantRun.of("short", trace, slow, {"goodput_rps": 1.0}, 10.0)
    assert sum(short.service.values()) == 297.0
    assert light_entitlement(short, alone) == pytest.approx(2 * 297 / 3 / 200)


def test_tenant_trace_weights() -> None:
    if not fb.SHAREGPT.is_file():
        pytest.skip("the kit's ShareGPT trace is not here")
    trace = fb.tenant_trace(fb.SHAREGPT, 20.0, 100.0, seed=3)
    heavy = sum(r.tenant == fb.HEAVY for r in trace) / len(trace)
    assert heavy == pytest.approx(8 / 15, abs=0.05)
    assert {r.tenant for r in trace} == {fb.HEAVY, *(f"t{i}" for i in range(1, 8))}
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)


def test_the_bench_runs_end_to_end(capsys) -> None:
    if not fb.SHAREGPT.is_file():
        pytest.skip("the kit's ShareGPT trace is not here")
    assert fb.main(["--seeds", "1", "--duration", "4", "--workers", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.match(
        r"^RESULT fairness jain=\S+ jain_lo=\S+ jain_hi=\S+ jain_unfair=\S+ .*"
        r"light_ttft_delta_pts=\S+ .*goodput_ratio=\S+ goodput_ratio_lo=\S+ goodput_ratio_hi=\S+ "
        r"light_entitled=\S+ .*$",
        lines[-1],
    )
    assert sum(line.startswith(("PASS at", "FAIL at")) for line in lines) == 2
