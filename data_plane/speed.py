"""The worker's measured speed, for gateways' admission, first-token deadlines and routing:
prompt tokens computed per second of the steps that computed any, the time of a decode-only
step, both smoothed over recent steps (EWMA), and a decode step's time as a function of its
batch size (:class:`DecodeFit`)."""

from __future__ import annotations

from shared.policy import Plan

# Weight of the newest step: about the last ten steps count.
ALPHA = 0.2
# The batch-size fit's weight of the newest decode step: about the last forty count.
FIT_ALPHA = 0.025
# Below this variance of the fitted steps' batch sizes there is no slope to fit.
MIN_BATCH_VARIANCE = 0.25
# ... and from this mean batch size the step time is taken as proportional to the batch.
PROPORTIONAL_FROM = 2.0


class DecodeFit:
    """A decode step's time as ``base_s + per_request_s x batch size``: exponentially weighted
    least squares over decode-only steps. Batch sizes too alike to fit a slope (a worker that
    ran one batch size for a while) give a time proportional to the batch from a mean batch of
    PROPORTIONAL_FROM (flat at that size, a worker left idle looked as slow as its last burst
    and drew nothing more), flat below it (one request at a time: proportional made it look
    half as fast at two, and a slower worker drew its requests); a negative slope (noise, or a
    flat device) gives a flat time. Both 0 until a step was observed."""

    def __init__(self, alpha: float = FIT_ALPHA) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], not {alpha}")
        self.alpha = alpha
        self._moments: tuple[float, float, float, float] | None = None  # n, t, n*n, n*t

    def observe(self, num_requests: int, step_s: float) -> None:
        new = (float(num_requests), step_s, float(num_requests) ** 2, num_requests * step_s)
        old = self._moments
        self._moments = (
            new
            if old is None
            else tuple(  # type: ignore[assignment]
                o + self.alpha * (x - o) for o, x in zip(old, new, strict=True)
            )
        )

    def coefficients(self) -> tuple[float, float]:
        """``(base_s, per_request_s)``; (0, 0): nothing observed."""
        if self._moments is None:
            return 0.0, 0.0
        n, t, nn, nt = self._moments
        variance = nn - n * n
        if variance < MIN_BATCH_VARIANCE:  # known at one batch size only
            return (0.0, t / n) if n >= PROPORTIONAL_FROM else (t, 0.0)
        per_request_s = (nt - n * t) / variance
        if per_request_s < 0.0:
            return t, 0.0
        base_s = t - per_request_s * n
        return (base_s, per_request_s) if base_s >= 0.0 else (0.0, t / max(n, 1.0))


class SpeedMeter:
    """Observes each step's plan and time. A chunk of more than one token is prefill, a chunk
    of one a decode (a prompt's last single token counts as a decode: a negligible error)."""

    def __init__(self, alpha: float = ALPHA) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], not {alpha}")
        self.alpha = alpha
        self._prefill_tokens = 0.0  # EWMA of prompt tokens per prefill step
        self._prefill_s = 0.0  # EWMA of those steps' times
        self.decode_step_s = 0.0  # EWMA of decode-only steps' times; 0: none measured yet
        self.decode_fit = DecodeFit()

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of prefill steps (the whole step's time, decodes sharing
        it included: the rate a queued prompt sees); 0 until one was measured."""
        return self._prefill_tokens / self._prefill_s if self._prefill_s > 0 else 0.0

    def observe(self, plan: Plan, step_s: float) -> None:
        """One executed step: ``plan`` is what it computed, ``step_s`` how long it took."""
        if step_s <= 0:
            return
        num_prefill = sum(chunk.num_tokens for chunk in plan.schedule if chunk.num_tokens > 1)
        if num_prefill > 0:
            self._prefill_tokens = self._smooth(self._prefill_tokens, num_prefill)
            self._prefill_s = self._smooth(self._prefill_s, step_s)
        elif plan.schedule:
            self.decode_step_s = self._smooth(self.decode_step_s, step_s)
            self.decode_fit.observe(len(plan.schedule), step_s)

    def _smooth(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.alpha * (new - old)
