"""Bootstrap confidence intervals over seeds (pure numpy, no I/O).

A judgment made from one seed of arrivals can pass by luck; over several seeds the percentile
bootstrap gives an interval for the statistic: resample the seeds with replacement (paired: every
policy's value of a seed travels together), recompute, take the 2.5th and 97.5th percentiles.
With few seeds the interval is rough but honest: it widens when the seeds disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

NUM_RESAMPLES = 2000
CONFIDENCE = 0.95


@dataclass(frozen=True, slots=True)
class Interval:
    """A statistic's value over all seeds and its bootstrap interval."""

    value: float
    lo: float
    hi: float

    def above(self, threshold: float) -> bool:
        """The whole interval is at or above ``threshold`` (a pass that is not luck)."""
        return self.lo >= threshold

    def fields(self, name: str) -> dict[str, float]:
        return {name: self.value, f"{name}_lo": self.lo, f"{name}_hi": self.hi}


def bootstrap(
    num_seeds: int,
    statistic: Callable[[np.ndarray], float],
    num_resamples: int = NUM_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Interval:
    """``statistic(indices)`` over all seeds and its percentile-bootstrap interval, resampling
    ``num_seeds`` seed indices with replacement (NaN resamples are dropped)."""
    if num_seeds < 1:
        raise ValueError(f"num_seeds must be >= 1, got {num_seeds}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    value = float(statistic(np.arange(num_seeds)))
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, num_seeds, size=(num_resamples, num_seeds))
    stats = np.array([statistic(idx) for idx in draws], dtype=np.float64)
    stats = stats[~np.isnan(stats)]
    if stats.size == 0:
        return Interval(value, float("nan"), float("nan"))
    tail = 100 * (1 - confidence) / 2
    lo, hi = np.percentile(stats, [tail, 100 - tail])
    return Interval(value, float(lo), float(hi))


def mean_interval(values: Sequence[float]) -> Interval:
    """The mean of per-seed ``values`` with its interval."""
    data = np.asarray(values, dtype=np.float64)
    return bootstrap(len(data), lambda idx: float(np.mean(data[idx])))


def ratio_interval(numerators: Sequence[float], denominators: Sequence[float]) -> Interval:
    """sum(numerators) / sum(denominators) over paired seeds (a ratio of means, defined when
    some denominators are 0), with its interval; inf when every resampled denominator is 0
    and a numerator is not."""
    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    if num.shape != den.shape:
        raise ValueError(f"paired values differ in length: {num.size} and {den.size}")

    def ratio(idx: np.ndarray) -> float:
        top, bottom = float(num[idx].sum()), float(den[idx].sum())
        if bottom > 0:
            return top / bottom
        return float("nan") if top == 0 else float("inf")

    return bootstrap(len(num), ratio)
