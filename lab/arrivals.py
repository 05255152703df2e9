"""Generated arrival times: gamma gaps (vLLM's ``--burstiness``) and a self-exciting (Hawkes)
process, whose bursts are correlated as production traffic's are.

Hawkes with an exponential kernel, simulated by its cluster (branching) representation:
immigrants arrive as a Poisson process of rate ``rps * (1 - branching)``; every event, immigrant
or child, begets ``Poisson(branching)`` children, each after an ``Exp(tau_s)`` delay. The
stationary mean rate is ``rps``; the share of arrivals that are children is ``branching``; a
burst lasts about ``tau_s / (1 - branching)``. The process starts ``BURN_IN_TAUS`` kernel
lifetimes before the window so the window sees the stationary rate, not a cold start.
"""

from __future__ import annotations

import numpy as np

BURN_IN_TAUS = 20.0
MAX_BRANCHING = 0.95  # at 1 the process explodes; near it one cluster would fill the window


def check_hawkes(rps: float, branching: float, tau_s: float) -> None:
    if not rps > 0:
        raise ValueError(f"rps must be > 0, got {rps}")
    if not 0.0 <= branching <= MAX_BRANCHING:
        raise ValueError(f"hawkes branching ratio must be in [0, {MAX_BRANCHING}], got {branching}")
    if not tau_s > 0:
        raise ValueError(f"hawkes tau_s must be > 0, got {tau_s}")


def hawkes_window(
    rps: float, branching: float, tau_s: float, duration_s: float, rng: np.random.Generator
) -> np.ndarray:
    """Sorted event times of the stationary process in ``[0, duration_s)``."""
    check_hawkes(rps, branching, tau_s)
    start_s = -BURN_IN_TAUS * tau_s / (1.0 - branching) if branching > 0 else 0.0
    span_s = duration_s - start_s
    num_immigrants = rng.poisson(rps * (1.0 - branching) * span_s)
    generation = start_s + rng.uniform(0.0, span_s, size=num_immigrants)
    events = [generation]
    while generation.size:
        counts = rng.poisson(branching, size=generation.size)
        children = np.repeat(generation, counts) + rng.exponential(tau_s, size=int(counts.sum()))
        generation = children[children < duration_s]
        events.append(generation)
    times_s = np.sort(np.concatenate(events))
    return times_s[times_s >= 0.0]


def hawkes_arrivals(
    rps: float,
    branching: float,
    tau_s: float,
    rng: np.random.Generator,
    duration_s: float | None,
    num_requests: int | None,
) -> np.ndarray:
    """Arrivals (the first at 0.0) before ``duration_s`` and at most ``num_requests`` of them
    (one of the two set); without a duration the window grows until it holds enough."""
    if duration_s is None and num_requests is None:
        raise ValueError("hawkes arrivals need duration_s or num_requests")
    window_s = duration_s if duration_s is not None else 2.0 * (num_requests or 0) / rps + 1.0
    while True:
        times_s = hawkes_window(rps, branching, tau_s, 2.0 * window_s, rng)
        if times_s.size:
            times_s = times_s - times_s[0]
        times_s = times_s[times_s < window_s]
        if duration_s is not None or num_requests is None or times_s.size >= num_requests:
            return times_s if num_requests is None else times_s[:num_requests]
        window_s *= 2.0
