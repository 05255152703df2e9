from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lab.traces import TraceRequest, arrivals, load_trace

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
AZURE = TRACES / "AzureLLMInferenceTrace_code_2023.csv"
MOONCAKE = TRACES / "mooncake_fast25_synthetic_trace.jsonl"
SHAREGPT = TRACES / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"


def _need(path: Path) -> str:
    if not path.is_file():
        pytest.skip(f"{path} is not present")
    return str(path)


def _load(spec: str, **kwargs: object) -> list[TraceRequest]:
    args: dict[str, object] = {"rps": None, "duration_s": None, "num_requests": None}
    args.update(kwargs)
    return load_trace(spec, **args)  # type: ignore[arg-type]


def _mean_rate(reqs: list[TraceRequest]) -> float:
    return (len(reqs) - 1) / (reqs[-1].arrival_s - reqs[0].arrival_s)


def _cv(times_s: np.ndarray) -> float:
    gaps_s = np.diff(times_s)
    return float(np.std(gaps_s) / np.mean(gaps_s))


def test_azure_first_rows() -> None:
    reqs = _load(_need(AZURE), num_requests=3)
    assert reqs[0] == TraceRequest(0.0, 4808, 10)
    assert reqs[1].arrival_s == pytest.approx(0.052, abs=1e-9)
    assert (reqs[1].input_len, reqs[1].output_len) == (3180, 8)
    assert reqs[2].arrival_s == pytest.approx(0.098189, abs=1e-9)


def test_azure_whole_file_sorted() -> None:
    reqs = _load(_need(AZURE))
    assert len(reqs) == 8819
    times_s = [r.arrival_s for r in reqs]
    assert times_s == sorted(times_s)
    assert 3400 < times_s[-1] < 3450  # 57.3 min span (SOURCES.md)


def test_azure_rescaled_rate() -> None:
    reqs = _load(_need(AZURE), rps=5.0, num_requests=1000)
    assert len(reqs) == 1000
    assert _mean_rate(reqs) == pytest.approx(5.0, rel=0.05)
    real = _load(_need(AZURE), num_requests=1000)
    ratio = [a.arrival_s / b.arrival_s for a, b in zip(reqs[1:], real[1:], strict=True)]
    assert max(ratio) == pytest.approx(min(ratio))  # burst shape kept: one common factor


def test_azure_duration_cut_with_rps() -> None:
    reqs = _load(_need(AZURE), rps=10.0, duration_s=120.0)
    assert all(r.arrival_s < 120.0 for r in reqs)
    assert abs(len(reqs) - 1200) <= 1


def test_mooncake_ms_to_s() -> None:
    path = _need(MOONCAKE)
    with open(path, encoding="utf-8") as f:
        first = [json.loads(next(f)) for _ in range(20)]
    reqs = _load(path, num_requests=20)
    for req, obj in zip(reqs, first, strict=True):
        assert req.arrival_s == pytest.approx(obj["timestamp"] / 1000.0)
        assert (req.input_len, req.output_len) == (obj["input_length"], obj["output_length"])
    whole = _load(path)
    assert len(whole) == 3993
    assert whole[-1].arrival_s == pytest.approx(1022.025)


def test_mooncake_rescaled_and_cut() -> None:
    reqs = _load(_need(MOONCAKE), rps=2.0, num_requests=500, duration_s=100.0)
    assert all(r.arrival_s < 100.0 for r in reqs)
    assert _mean_rate(reqs) == pytest.approx(2.0, rel=0.05)


def test_detection_uses_content_not_name(tmp_path: Path) -> None:
    path = tmp_path / "azure_looking_name.txt"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": []}\n'
        '{"timestamp": 250, "input_length": 7, "output_length": 3, "hash_ids": []}\n'
    )
    assert _load(str(path)) == [TraceRequest(0.0, 5, 2), TraceRequest(0.25, 7, 3)]


def test_stats_sampling_reproducible_and_from_file() -> None:
    path = _need(SHAREGPT)
    a = _load(path, rps=4.0, num_requests=300, seed=7)
    b = _load(path, rps=4.0, num_requests=300, seed=7)
    c = _load(path, rps=4.0, num_requests=300, seed=8)
    assert a == b
    assert a != c
    with open(path, encoding="utf-8") as f:
        next(f)
        pairs = {(int(p), int(d)) for p, d, *_ in (line.split(",") for line in f)}
    assert all((r.input_len, r.output_len) in pairs for r in a)
    assert len({(r.input_len, r.output_len) for r in a}) > 200  # really sampled, not one row


def test_stats_duration_cut() -> None:
    reqs = _load(_need(SHAREGPT), rps=5.0, duration_s=60.0)
    assert reqs[0].arrival_s == 0.0
    assert all(r.arrival_s < 60.0 for r in reqs)
    assert 240 < len(reqs) < 360


def test_synthetic_lengths() -> None:
    assert {(r.input_len, r.output_len) for r in _load("synthetic", rps=1.0, num_requests=5)} == {
        (512, 128)
    }
    reqs = _load("synthetic:100:7", rps=1.0, num_requests=5)
    assert {(r.input_len, r.output_len) for r in reqs} == {(100, 7)}


def test_poisson_mean_rate() -> None:
    times_s = arrivals(5000, 20.0, 1.0, np.random.default_rng(0))
    assert times_s[0] == 0.0
    assert np.all(np.diff(times_s) >= 0)
    assert 4999 / times_s[-1] == pytest.approx(20.0, rel=0.10)
    assert _cv(times_s) == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_cv(burstiness: float) -> None:
    times_s = arrivals(20000, 10.0, burstiness, np.random.default_rng(1))
    assert _cv(times_s) == pytest.approx(1.0 / np.sqrt(burstiness), rel=0.1)
    assert 19999 / times_s[-1] == pytest.approx(10.0, rel=0.1)


def test_burstiness_direction_through_load_trace() -> None:
    def cv_of(burstiness: float) -> float:
        reqs = _load("synthetic", rps=10.0, num_requests=5000, burstiness=burstiness)
        return _cv(np.array([r.arrival_s for r in reqs]))

    assert cv_of(0.3) > cv_of(1.0) > cv_of(3.0)


def test_clipping_keeps_one_token() -> None:
    reqs = _load(_need(AZURE), num_requests=50, max_input_len=100, max_output_len=1)
    assert all(1 <= r.input_len <= 100 and r.output_len == 1 for r in reqs)
    with pytest.raises(ValueError, match="max_output_len must be >= 1"):
        _load(_need(AZURE), num_requests=5, max_output_len=0)


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ("/no/such/trace.csv", {}, "trace file not found"),
        ("synthetic", {"num_requests": 5}, "needs rps"),
        ("synthetic", {"rps": 0.0, "num_requests": 5}, "rps must be > 0"),
        ("synthetic", {"rps": -1.0, "num_requests": 5}, "rps must be > 0"),
        ("synthetic", {"rps": 1.0}, "needs duration_s or num_requests"),
        ("synthetic:12", {"rps": 1.0, "num_requests": 5}, "bad synthetic spec"),
        ("synthetic:a:b", {"rps": 1.0, "num_requests": 5}, "bad synthetic spec"),
    ],
)
def test_bad_specs(spec: str, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _load(spec, **kwargs)


def test_stats_without_rps() -> None:
    with pytest.raises(ValueError, match="needs rps"):
        _load(_need(SHAREGPT), num_requests=5)


def test_unknown_format(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match="unknown trace format"):
        _load(str(path))


def test_burstiness_rejected_for_real_arrivals() -> None:
    with pytest.raises(ValueError, match="real arrival times"):
        _load(_need(AZURE), num_requests=5, burstiness=2.0)
