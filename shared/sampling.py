"""Sampling parameters: one type from the gateway's OpenAI request to the engine's sampler.

The gateway builds it once from the request body (``gateway/sampling.py``), sends it inside
:class:`shared.protocol.SubmitRequest`, and the worker's engine samples with it as received;
the offline engine (``superinfer generate``) builds it directly. Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from shared.logprobs import MAX_LOGPROBS

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What every output must match: ``kind`` "json" (``spec``: a JSON schema), "regex",
    "choice" (``spec``: a JSON list of the strings allowed) or "grammar" (EBNF, xgrammar's
    dialect of GBNF). The worker compiles it; one it cannot compile is the client's 400."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int | None = None  # None: off
    seed: int | None = None
    # Stop strings are checked where the text is decoded: by the gateway when serving (it
    # sends them to no worker), by the engine offline.
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Below this many output tokens, EOS and stop_token_ids are never sampled and stop strings
    # do not count (vLLM's min_tokens).
    min_tokens: int = 0
    min_p: float = 0.0  # tokens under min_p x the most likely one's probability are dropped
    include_stop_str_in_output: bool = False  # the stop string ends the text (not cut)
    # OpenAI's penalties over the generated tokens (logit -= frequency x count + presence if
    # seen), vLLM's / transformers' repetition penalty over prompt and generated tokens (a
    # seen token's logit divided by it when positive, multiplied when negative), and
    # OpenAI's logit_bias (added to the logits of those ids): all before temperature.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias_ids: tuple[int, ...] = ()
    logit_bias_values: tuple[float, ...] = ()
    # Log-probabilities (shared/logprobs.py): None asks for none; N >= 0 for each sampled token
    # (``logprobs``) or each prompt token after the first (``prompt_logprobs``) its own and
    # the N most likely. A request with prompt_logprobs takes no prefix-cache hit (its prompt
    # is computed whole, as in vLLM).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # structured outputs: tokens outside it masked

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias_ids
        )

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or unset, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}"
            )
        if len(self.logit_bias_ids) != len(self.logit_bias_values):
            raise ValueError("logit_bias_ids and logit_bias_values differ in length")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in 0..{MAX_LOGPROBS} or unset, got {value}")
