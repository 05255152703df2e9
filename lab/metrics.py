"""SLO metrics from per-request timelines (pure functions, no I/O).

A :class:`RequestTimeline` is what a client sees of one request: its arrival time, the time of
every output token, and its SLOs (S_F for the first token, S_B between tokens). Used by the
simulator (``lab/sim``) and the load generator (``superinfer bench``) alike; both write
result rows whose first keys are :data:`ROW_KEYS`, the SLO part built by :func:`slo_fields`.
Definitions (SUPERINFER.md §1, §7):

- TTFT = first token time - arrival; met when TTFT <= S_F. A request that produced no token
  (rejected, aborted, never served) misses it.
- TBT = every gap between two consecutive tokens of a request; TBT attainment is the fraction
  of all gaps (over all requests) with gap <= S_B.
- TPOT = (last token - first token) / (tokens - 1), vLLM's mean time per output token after the
  first; met when TPOT <= S_B. A one-token request meets it (nothing to wait for); a request
  with no token, or one that did not finish (a run cut at a time horizon), misses it.
- goodput = requests meeting both the TTFT and TPOT SLOs, per second of the run (vLLM's
  ``--goodput ttft:... tpot:...``); SLO attainment = the fraction of requests meeting both
  (DistServe's: a rate is within capacity when it is >= 90 %); output token throughput =
  output tokens per second.
- stall-free SLO attainment = the fraction meeting both and never pausing longer than
  ``STALL_X_SB`` x S_B between two tokens (1 s at 100 ms): a mean TPOT can be met by a stream
  that freezes for many seconds once it is ahead of its schedule, which a reader sees.

The run's duration is the first arrival to the last token (the queue's drain included), unless
the caller passes one. Percentiles interpolate linearly (numpy's default); None when there is
no value to take one of. SLO comparisons allow ``SLO_EPS_S`` (1 ns) of float rounding, so a
gap of exactly S_B computed as a difference of two timestamps counts as met.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SLO_EPS_S = 1e-9
STALL_X_SB = 10.0  # a gap longer than this many S_B is a stall (stall-free attainment)
# Keys of one result row of `superinfer simulate` and `superinfer bench`, in order.
ROW_KEYS = (
    "policy",
    "rps",
    "num_requests",
    "ttft_attainment",
    "tbt_attainment",
    "tpot_attainment",
    "slo_attainment",
    "stall_free_attainment",
    "goodput_rps",
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tbt_p50_s",
    "tbt_p99_s",
    "preemptions",
    "rotations",
    "bytes_h2d",
    "bytes_d2h",
    "exposed_transfer_s",
)


@dataclass(frozen=True, slots=True)
class RequestTimeline:
    arrival_s: float
    token_times_s: Sequence[float]
    slo_ttft_s: float
    slo_tbt_s: float
    finished: bool = True  # False: the run ended before the request's last token
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class SloSummary:
    num_requests: int
    num_served: int  # requests with at least one token
    num_unfinished: int
    ttft_attainment: float
    tbt_attainment: float
    tpot_attainment: float
    slo_attainment: float  # requests meeting both TTFT and TPOT, of all requests
    stall_free_attainment: float  # ... and no gap over STALL_X_SB x S_B
    goodput_rps: float
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tbt_p50_s: float | None
    tbt_p99_s: float | None
    duration_s: float
    num_output_tokens: int


def ttft_s(timeline: RequestTimeline) -> float | None:
    """Time to first token, None if there is no token."""
    if not timeline.token_times_s:
        return None
    return timeline.token_times_s[0] - timeline.arrival_s


def tbt_gaps_s(timeline: RequestTimeline) -> list[float]:
    """Gaps between consecutive tokens (one fewer than the tokens)."""
    times = timeline.token_times_s
    return [times[i + 1] - times[i] for i in range(len(times) - 1)]


def tpot_s(timeline: RequestTimeline) -> float | None:
    """Mean time per output token after the first; None with fewer than two tokens."""
    times = timeline.token_times_s
    if len(times) < 2:
        return None
    return (times[-1] - times[0]) / (len(times) - 1)


def meets_ttft(timeline: RequestTimeline) -> bool:
    value = ttft_s(timeline)
    return value is not None and value <= timeline.slo_ttft_s + SLO_EPS_S


def meets_tpot(timeline: RequestTimeline) -> bool:
    if not timeline.token_times_s or not timeline.finished:
        return False
    value = tpot_s(timeline)
    return value is None or value <= timeline.slo_tbt_s + SLO_EPS_S


def stalls(timeline: RequestTimeline) -> bool:
    """Whether two consecutive tokens are more than ``STALL_X_SB`` x S_B apart."""
    times = timeline.token_times_s
    limit = STALL_X_SB * timeline.slo_tbt_s + SLO_EPS_S
    return any(times[i + 1] - times[i] > limit for i in range(len(times) - 1))


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def run_duration_s(timelines: Sequence[RequestTimeline]) -> float:
    """First arrival to last token (0.0 when nothing was served)."""
    last = max((t.token_times_s[-1] for t in timelines if t.token_times_s), default=None)
    if last is None:
        return 0.0
    return last - min(t.arrival_s for t in timelines)


def _all_gaps(timelines: Sequence[RequestTimeline]) -> tuple[np.ndarray, np.ndarray]:
    """(every inter-token gap, the S_B of its request), vectorised over all requests."""
    served = [t for t in timelines if len(t.token_times_s) >= 2]
    if not served:
        empty = np.zeros(0, dtype=np.float64)
        return empty, empty
    lengths = np.fromiter((len(t.token_times_s) for t in served), dtype=np.int64)
    times = np.concatenate([np.asarray(t.token_times_s, dtype=np.float64) for t in served])
    gaps = np.diff(times)
    keep = np.ones(len(gaps), dtype=bool)
    keep[np.cumsum(lengths)[:-1] - 1] = False  # the jump from one request to the next
    slos = np.repeat(np.fromiter((t.slo_tbt_s for t in served), dtype=np.float64), lengths - 1)
    return gaps[keep], slos


def summarize(timelines: Sequence[RequestTimeline], duration_s: float | None = None) -> SloSummary:
    """Attainment, goodput, throughput and latency percentiles of one run."""
    if duration_s is not None and duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    n = len(timelines)
    duration = run_duration_s(timelines) if duration_s is None else duration_s
    ttfts = [v for v in (ttft_s(t) for t in timelines) if v is not None]
    ttft_ok = [meets_ttft(t) for t in timelines]
    tpot_ok = [meets_tpot(t) for t in timelines]
    gaps, gap_slos = _all_gaps(timelines)
    num_tokens = sum(len(t.token_times_s) for t in timelines)
    good = [a and b for a, b in zip(ttft_ok, tpot_ok, strict=True)]
    num_good = sum(good)
    num_stall_free = sum(1 for ok, t in zip(good, timelines, strict=True) if ok and not stalls(t))
    return SloSummary(
        num_requests=n,
        num_served=len(ttfts),
        num_unfinished=sum(1 for t in timelines if not t.finished),
        ttft_attainment=sum(ttft_ok) / n if n else 1.0,
        tbt_attainment=float(np.mean(gaps <= gap_slos + SLO_EPS_S)) if len(gaps) else 1.0,
        tpot_attainment=sum(tpot_ok) / n if n else 1.0,
        slo_attainment=num_good / n if n else 1.0,
        stall_free_attainment=num_stall_free / n if n else 1.0,
        goodput_rps=num_good / duration if duration > 0 else 0.0,
        output_tokens_per_s=num_tokens / duration if duration > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        tbt_p50_s=percentile(gaps, 50),
        tbt_p99_s=percentile(gaps, 99),
        duration_s=duration,
        num_output_tokens=num_tokens,
    )


def slo_fields(summary: SloSummary) -> dict[str, float | None]:
    """The SLO part of a result row (``ttft_attainment`` .. ``tbt_p99_s`` of :data:`ROW_KEYS`)."""
    return {
        "ttft_attainment": summary.ttft_attainment,
        "tbt_attainment": summary.tbt_attainment,
        "tpot_attainment": summary.tpot_attainment,
        "slo_attainment": summary.slo_attainment,
        "stall_free_attainment": summary.stall_free_attainment,
        "goodput_rps": summary.goodput_rps,
        "output_tokens_per_s": summary.output_tokens_per_s,
        "ttft_p50_s": summary.ttft_p50_s,
        "ttft_p99_s": summary.ttft_p99_s,
        "tbt_p50_s": summary.tbt_p50_s,
        "tbt_p99_s": summary.tbt_p99_s,
    }


def latency_stats_ms(
    name: str, values_s: Sequence[float], percentiles: Sequence[float] = ()
) -> dict[str, float | None]:
    """vLLM's ``mean_<name>_ms``, ``median_<name>_ms``, ``std_<name>_ms``, ``p99_<name>_ms``
    and ``p<P>_<name>_ms`` for each of ``percentiles`` (vLLM's ``--metric-percentiles``) of
    ``values_s`` (seconds in, milliseconds out; None for no values)."""
    stats = ["mean", "median", "std", *(percentile_key(p) for p in sorted({99.0, *percentiles}))]
    if len(values_s) == 0:
        return {f"{stat}_{name}_ms": None for stat in stats}
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out: dict[str, float | None] = {
        f"mean_{name}_ms": float(np.mean(values_ms)),
        f"median_{name}_ms": float(np.median(values_ms)),
        f"std_{name}_ms": float(np.std(values_ms)),
    }
    for p in sorted({99.0, *percentiles}):
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(values_ms, p))
    return out


def percentile_key(percentile: float) -> str:
    """vLLM's name of a percentile: ``p99``, ``p99.9``."""
    return f"p{int(percentile)}" if percentile == int(percentile) else f"p{percentile:g}"
