"""The fit behind `superinfer profile` (``lab/profile.py``): timed engine steps ->
least-squares step costs -> a :class:`lab.costmodel.CostProfile` whose iteration time is the
fit, with the model's real sizes where the fit leaves them free."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lab.costmodel import CostProfile

_HUGE_RATE = 1e18  # a term the fit found free: a rate so high that it costs nothing


@dataclass(frozen=True, slots=True)
class StepSample:
    num_prefill_tokens: int
    num_decode_seqs: int
    num_context_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class StepFit:
    intercept_s: float
    prefill_token_s: float
    context_token_s: float
    r_squared: float
    max_rel_error: float
    num_samples: int  # timed steps
    num_shapes: int  # distinct (prefill, context) shapes the fit kept

    def predict_s(self, num_prefill_tokens: int, num_context_tokens: int) -> float:
        return (
            self.intercept_s
            + self.prefill_token_s * num_prefill_tokens
            + self.context_token_s * num_context_tokens
        )


def fit_step_costs(samples: list[StepSample]) -> StepFit:
    """Step time on (1, prefill tokens, context tokens): the median time of each distinct
    shape (so a step stalled by another process does not count), fitted by least squares of
    the relative error with coefficients >= 0; shapes the first fit misses by more than 3x
    the median relative miss (and 20 %) are dropped and the rest refitted."""
    shapes: dict[tuple[int, int], list[float]] = {}
    for sample in samples:
        key = (sample.num_prefill_tokens, sample.num_context_tokens)
        shapes.setdefault(key, []).append(sample.seconds)
    if len(shapes) < 3:
        raise ValueError(f"need at least 3 distinct step shapes to fit, got {len(shapes)}")
    x = np.array([[1.0, p, c] for p, c in shapes], dtype=np.float64)
    y = np.array([float(np.median(times)) for times in shapes.values()], dtype=np.float64)
    coef = _nonnegative_fit(x, y)
    rel = np.abs(x @ coef - y) / y
    keep = rel <= max(0.2, 3 * float(np.median(rel)))
    if keep.sum() >= 3 and not keep.all():
        x, y = x[keep], y[keep]
        coef = _nonnegative_fit(x, y)
    predicted = x @ coef
    total = float(((y - y.mean()) ** 2).sum())
    residual = float(((y - predicted) ** 2).sum())
    return StepFit(
        float(coef[0]),
        float(coef[1]),
        float(coef[2]),
        1.0 - residual / total if total > 0 else 1.0,
        float(np.max(np.abs(predicted - y) / y)),
        len(samples),
        len(y),
    )


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients >= 0 minimising the squared relative error (a negative one is fixed at
    0 and the others refitted)."""
    if (y <= 0).any():
        raise ValueError("step times must be > 0")
    xw, yw = x / y[:, None], np.ones_like(y)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return coef


@dataclass(frozen=True, slots=True)
class ModelSizes:
    name: str
    num_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    block_size: int


def build_profile(
    sizes: ModelSizes, fit: StepFit, link: tuple[float, float, float], how: str
) -> CostProfile:
    """The fit in the profile's physical terms (``lab/profile.py``'s docstring): its
    iteration time is the fitted step time; ``how`` names the run."""
    hbm_bw = sizes.kv_bytes_per_token / fit.context_token_s if fit.context_token_s > 0 else 0.0
    hbm_bw = hbm_bw or _HUGE_RATE
    weight_bytes = float(sizes.weight_bytes)
    weight_note = f"{sizes.num_params} parameters x their element size"
    if weight_bytes / hbm_bw > fit.intercept_s:  # the intercept is all the step constant there is
        weight_bytes = max(1.0, fit.intercept_s * hbm_bw)
        weight_note = (
            f"effective: the fitted intercept at the effective bandwidth (the real weights,"
            f" {sizes.weight_bytes} B, would take longer than the whole intercept at that rate)"
        )
    weight_s = weight_bytes / hbm_bw
    flops_per_token = 2.0 * sizes.num_params
    peak = flops_per_token / fit.prefill_token_s if fit.prefill_token_s > 0 else _HUGE_RATE
    h2d, d2h, both = link
    return CostProfile(
        name=sizes.name,
        source=how,
        fixed_overhead_s=max(0.0, fit.intercept_s - weight_s),
        weight_bytes=weight_bytes,
        hbm_bandwidth_bytes_s=hbm_bw,
        flops_per_token=flops_per_token,
        peak_flops=peak,
        kv_bytes_per_token=float(sizes.kv_bytes_per_token),
        link_h2d_bytes_s=h2d,
        link_d2h_bytes_s=d2h,
        duplex=True,
        link_duplex_bytes_s=both,
        block_size_tokens=sizes.block_size,
        sources=_sources(fit, how, weight_s, weight_note),
    )


def _sources(fit: StepFit, how: str, weight_s: float, weight_note: str) -> dict[str, str]:
    fit_text = (
        f"{how}: step_s = {fit.intercept_s:.6g} + {fit.prefill_token_s:.6g} x prefill_tokens"
        f" + {fit.context_token_s:.6g} x context_tokens over {fit.num_samples} timed steps"
        f" ({fit.num_shapes} shapes kept; R^2 {fit.r_squared:.4f}, worst relative error"
        f" {fit.max_rel_error:.2f})"
    )
    copies = "scattered blocks with the transfer backend, best of 3"
    return {
        "fixed_overhead_s": f"fit intercept {fit.intercept_s:.6g} s minus the weight-read term"
        f" {weight_s:.6g} s. {fit_text}",
        "weight_bytes": weight_note,
        "hbm_bandwidth_bytes_s": "effective: kv_bytes_per_token / fitted seconds per context"
        " token (attention's KV read and every per-token cost that grows with context)",
        "flops_per_token": "2 FLOP per parameter per token",
        "peak_flops": "effective: flops_per_token / fitted seconds per prefill token",
        "kv_bytes_per_token": "layers x 2 (K, V) x KV heads x head_dim x element size",
        "link_h2d_bytes_s": f"measured: DRAM -> HBM pool, {copies}",
        "link_d2h_bytes_s": f"measured: HBM -> DRAM pool, {copies}",
        "duplex": "both directions submitted together (one copy thread or stream each)",
        "link_duplex_bytes_s": f"measured: both directions at once, aggregate, {copies}",
        "block_size_tokens": "the engine's block size for this run",
    }
