"""How the gateway's router spreads requests over workers (``shared.policy.least_loaded``'s
``LAG_TOLERANCE``), in virtual time: workers whose step time grows with their batch (CPU-like:
steeply; GPU-like: barely) and carries noise, statuses seen every heartbeat (0.5 s), Poisson
and bursty arrivals of decode-heavy requests. Each router sees what the gateway sees: the last
status (mean step time over its period, or idle: the EWMA of the steps it last ran; requests
held; its decode step's fit to the batch size, ``data_plane.speed.DecodeFit``) plus what it sent
since. Compared: lag from the status's step time alone (the rule before) and the product's
rule (step time from the fit at the requests the worker would hold, ``least_loaded``) with
tolerances 0, 0.1, 0.25 (the product's) and 0.5; on like workers and on pairs where one is
twice as slow. Reported per case: mean and
p99 time between tokens (the step time each token waited), mean request latency, and each
rule's ratios to lag alone's. Ends with a RESULT line.

    .venv/bin/python bench/routing_balance.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

import numpy as np

from data_plane.speed import DecodeFit
from shared.policy import decode_step_s, kv_usage, least_loaded, predicted_lag_s

HEARTBEAT_S = 0.5  # the workers' default heartbeat_interval_s (statuses rebuilt as often)
BURST = 12
RULES = ("lag", "0.0", "0.1", "0.25", "0.5")
# (name, per-worker base step s, step growth per request held as a fraction of the base)
CASES = (
    ("cpu_like_x2", (0.02, 0.02), 0.08),
    ("gpu_like_x2", (0.01, 0.01), 0.004),
    ("gpu_like_x4", (0.01,) * 4, 0.004),
    ("cpu_one_slow", (0.02, 0.04), 0.08),
    ("gpu_one_slow", (0.01, 0.02), 0.004),
)


@dataclass
class Worker:
    base_s: float
    growth: float
    requests: list[list[float]] = field(default_factory=list)  # [tokens left, t_arrival]
    clock_s: float = 0.0
    step_times: list[float] = field(default_factory=list)
    idle_step_s: float = 0.0  # an idle worker reports its decode steps' EWMA (speed.py)
    # requests held, mean step s of the last period (idle: idle_step_s), the decode fit
    reported: tuple[int, float, tuple[float, float]] = (0, 0.0, (0.0, 0.0))
    busy_step_s: float = 0.0  # the status's iteration_time_s: 0 when idle over its period
    fit: DecodeFit = field(default_factory=DecodeFit)
    sent_since: int = 0

    def step(self, rng: np.random.Generator, gaps: list[float], latencies: list[float]) -> None:
        n = len(self.requests)
        step_s = self.base_s * (1.0 + self.growth * n) * rng.lognormal(0.0, 0.15)
        self.clock_s += step_s
        self.step_times.append(step_s)
        self.fit.observe(n, step_s)
        self.idle_step_s = step_s if not self.idle_step_s else 0.8 * self.idle_step_s + 0.2 * step_s
        gaps.extend([step_s] * n)
        for request in self.requests:
            request[0] -= 1
        latencies.extend(self.clock_s - r[1] for r in self.requests if r[0] <= 0)
        self.requests = [r for r in self.requests if r[0] > 0]


def _arrivals(rng: np.random.Generator, rate: float, seconds: float, bursty: bool) -> np.ndarray:
    if not bursty:
        return np.cumsum(rng.exponential(1.0 / rate, int(rate * seconds)))
    # bursts of BURST requests within 50 ms, at the same mean rate
    starts = np.cumsum(rng.exponential(BURST / rate, max(1, int(seconds * rate / BURST))))
    return np.sort(np.concatenate([s + rng.uniform(0, 0.05, BURST) for s in starts]))


def _choose(workers: list[Worker], rule: str) -> int:
    """``lag``: the rule before (least predicted lag from the status's step time); a number:
    the product's rule with that tolerance (``least_loaded`` over lags whose step time comes
    from each worker's decode fit at the requests it would hold; the product's is 0.25)."""
    held = [w.reported[0] + w.sent_since for w in workers]
    if rule == "lag":
        steps_s = [w.reported[1] for w in workers]
    else:
        fitted = [decode_step_s(*w.reported[2], n + 1) for w, n in zip(workers, held, strict=True)]
        steps_s = [
            w.reported[1] if f is None else max(w.busy_step_s, f)
            for w, f in zip(workers, fitted, strict=True)
        ]
    lags_s = [predicted_lag_s(step_s, 0, 2048, kv_usage(0, 0)) for step_s in steps_s]
    if rule == "lag":
        return int(np.argmin(lags_s))
    return least_loaded(lags_s, held, float(rule))


def run(
    case: tuple[str, tuple[float, ...], float], rule: str, seed: int, bursty: bool
) -> tuple[float, float, float]:
    _, bases, growth = case
    rng = np.random.default_rng(seed)
    workers = [Worker(b, growth) for b in bases]
    capacity = sum(1.0 / (b * (1 + growth * 8)) for b in bases) / 120.0  # requests/s at ~8 each
    arrivals = _arrivals(rng, 0.7 * capacity, 300.0, bursty)
    gaps: list[float] = []
    latencies: list[float] = []
    t_status_s, i = 0.0, 0
    while i < len(arrivals) or any(w.requests for w in workers):
        now = min(w.clock_s for w in workers)
        while now >= t_status_s:  # every heartbeat: statuses seen, sends counted afresh
            for w in workers:
                idle = not w.step_times
                step_s = w.idle_step_s or w.base_s if idle else float(np.mean(w.step_times))
                w.reported = (len(w.requests), step_s, w.fit.coefficients())
                w.busy_step_s = 0.0 if idle else step_s
                w.step_times, w.sent_since = [], 0
            t_status_s += HEARTBEAT_S
        while i < len(arrivals) and arrivals[i] <= now:
            target = workers[_choose(workers, rule)]
            target.requests.append([float(rng.integers(60, 180)), float(arrivals[i])])
            target.sent_since += 1
            i += 1
        for w in workers:  # idle workers wait for the next arrival
            if not w.requests:
                w.clock_s = max(w.clock_s, arrivals[i] if i < len(arrivals) else now + 1)
        busy = [w for w in workers if w.requests]
        if busy:
            min(busy, key=lambda w: w.clock_s).step(rng, gaps, latencies)
    return float(np.mean(gaps)), float(np.percentile(gaps, 99)), float(np.mean(latencies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} (virtual time: the host's load does not count)")
    worst = {t: 0.0 for t in RULES}
    for case in CASES:
        for bursty in (False, True):
            seeds = range(args.seeds)
            rows = {r: np.mean([run(case, r, s, bursty) for s in seeds], 0) for r in RULES}
            base = rows["lag"]
            label = f"{case[0]} {'bursts' if bursty else 'poisson'}"
            for t, (gap, p99, lat) in rows.items():
                ratio = p99 / base[1]
                worst[t] = max(worst[t], ratio, lat / base[2])
                print(
                    f"{label:22s} {t:>12s}: TBT mean {gap * 1e3:6.1f} ms p99 "
                    f"{p99 * 1e3:6.1f} ms latency {lat:5.2f} s  p99/lag-only {ratio:.3f} "
                    f"latency/lag-only {lat / base[2]:.3f}"
                )
    fields = " ".join(f"worst_ratio_{r}={worst[r]:.3f}" for r in RULES[1:])
    print(f"RESULT routing_balance {fields}")


if __name__ == "__main__":
    main()
