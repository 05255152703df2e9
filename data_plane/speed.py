"""The worker's measured speed, for gateways' admission and first-token deadlines: prompt
tokens computed per second of the steps that computed any, and the time of a decode-only step,
both smoothed over recent steps (EWMA)."""

from __future__ import annotations

from shared.policy import Plan

# Weight of the newest step: about the last ten steps count.
ALPHA = 0.2


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

    def _smooth(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.alpha * (new - old)
