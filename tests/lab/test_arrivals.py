"""Hawkes arrivals against the process's closed-form moments, and trace windows per seed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lab.arrivals import hawkes_arrivals, hawkes_window
from lab.traces import load_trace, window_start

KIT_TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
AZURE = KIT_TRACES / "AzureLLMInferenceTrace_code_2023.csv"


@pytest.mark.parametrize("branching", [0.0, 0.5, 0.8])
def test_hawkes_mean_rate_is_rps(branching: float) -> None:
    rng = np.random.default_rng(7)
    times_s = hawkes_window(10.0, branching, 0.5, 2000.0, rng)
    # the stationary rate is rps whatever the branching ratio: 20,000 events expected
    assert times_s.size == pytest.approx(20_000, rel=0.1 if branching else 0.03)
    assert np.all(np.diff(times_s) >= 0) and times_s[0] >= 0 and times_s[-1] < 2000.0


def test_hawkes_counts_are_overdispersed_as_the_theory_says() -> None:
    """Over windows much longer than a burst, var/mean of the counts -> 1 / (1 - n)^2."""
    rng = np.random.default_rng(3)
    for branching, expected in ((0.0, 1.0), (0.5, 4.0)):
        times_s = hawkes_window(20.0, branching, 0.2, 4000.0, rng)
        counts = np.histogram(times_s, bins=np.arange(0.0, 4000.0 + 1e-9, 20.0))[0]
        assert counts.var() / counts.mean() == pytest.approx(expected, rel=0.35), branching


def test_hawkes_arrivals_limits() -> None:
    rng = np.random.default_rng(0)
    by_count = hawkes_arrivals(5.0, 0.6, 1.0, rng, None, 300)
    assert by_count.size == 300 and by_count[0] == 0.0
    by_time = hawkes_arrivals(5.0, 0.6, 1.0, rng, 30.0, None)
    assert by_time[0] == 0.0 and by_time[-1] < 30.0
    for bad in ({"branching": 1.0}, {"branching": -0.1}, {"tau_s": 0.0}):
        kwargs = {"rps": 5.0, "branching": 0.5, "tau_s": 1.0, "duration_s": 10.0, **bad}
        with pytest.raises(ValueError):
            hawkes_window(rng=rng, **kwargs)


def test_load_trace_hawkes_and_its_refusals() -> None:
    reqs = load_trace("synthetic:64:8", rps=4.0, duration_s=50.0, num_requests=None, hawkes=0.5)
    assert reqs[0].arrival_s == 0.0 and all(r.input_len == 64 for r in reqs)
    with pytest.raises(ValueError, match="choose one"):
        load_trace(
            "synthetic", rps=4.0, duration_s=5.0, num_requests=None, hawkes=0.5, burstiness=2
        )
    if AZURE.exists():
        with pytest.raises(ValueError, match=r"hawkes=0\.5 applies only to generated"):
            load_trace(str(AZURE), rps=4.0, duration_s=5.0, num_requests=None, hawkes=0.5)


def test_window_start_walks_and_wraps() -> None:
    assert [window_start(100, 30, s) for s in range(5)] == [0, 30, 60, 19, 49]  # 71 starts
    assert window_start(10, 50, 3) == 0  # a window longer than the trace: the whole trace
    with pytest.raises(ValueError):
        window_start(100, 30, -1)


@pytest.mark.skipif(not AZURE.exists(), reason="the kit's Azure trace is not here")
def test_real_trace_seeds_take_successive_windows() -> None:
    whole = load_trace(str(AZURE), rps=None, duration_s=None, num_requests=None)
    first = load_trace(str(AZURE), rps=None, duration_s=None, num_requests=40, seed=0)
    second = load_trace(str(AZURE), rps=None, duration_s=None, num_requests=40, seed=1)
    lengths = [(r.input_len, r.output_len) for r in whole]
    assert [(r.input_len, r.output_len) for r in first] == lengths[:40]
    assert [(r.input_len, r.output_len) for r in second] == lengths[40:80]
    assert second[0].arrival_s == 0.0
    gaps = np.diff([r.arrival_s for r in whole[40:80]])
    assert np.diff([r.arrival_s for r in second]) == pytest.approx(gaps)  # shape kept (rps None)
