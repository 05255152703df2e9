"""Stop conditions and incremental text for one newly sampled token."""

from __future__ import annotations

from data_plane.engine.request import FinishReason, Request
from shared.tokenizer import Tokenizer


def check_stop(
    request: Request,
    token: int,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
    tokenizer: Tokenizer | None,
) -> tuple[FinishReason | None, str]:
    """Returns (finish reason or None, text delta). The EOS token stays in the token ids but
    not in the text; a stop string ends the text before it (vLLM's default)."""
    params = request.params
    is_eos = not params.ignore_eos and token in eos_token_ids
    reason: FinishReason | None = None
    if is_eos or token in params.stop_token_ids:
        reason = FinishReason.STOP
    elif len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= max_model_len:
        reason = FinishReason.LENGTH
    if tokenizer is None or (reason is FinishReason.STOP and is_eos):
        return reason, ""
    text = _decode_output(request, tokenizer)
    if text.endswith("\ufffd") and reason is None:
        return reason, ""  # an incomplete UTF-8 sequence: wait for the next token
    for stop in params.stop:
        index = text.find(stop, max(0, len(request.text) - len(stop) + 1))
        if index >= 0:
            text = text[:index]
            reason = FinishReason.STOP
            break
    if reason is None and params.stop:
        # Hold back a tail that may be the start of a stop string (never stream half of one).
        text = text[: len(text) - (max(len(s) for s in params.stop) - 1)]
    if len(text) < len(request.text):
        return reason, ""
    delta = text[len(request.text) :]
    request.text = text
    return reason, delta


def _decode_output(request: Request, tokenizer: Tokenizer) -> str:
    if request.prompt_text_len is None:
        request.prompt_text_len = len(tokenizer.decode(request.prompt_token_ids))
    return tokenizer.decode(request.all_token_ids)[request.prompt_text_len :]
