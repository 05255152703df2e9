"""Stop conditions and incremental text for one newly sampled token."""

from __future__ import annotations

from data_plane.engine.request import FinishReason, Request
from shared.detokenizer import IncrementalDetokenizer
from shared.tokenizer import Tokenizer


def check_stop(
    request: Request,
    token: int,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
    tokenizer: Tokenizer | None,
) -> tuple[FinishReason | None, str]:
    """Returns (finish reason or None, text delta). A stop token (EOS, ``stop_token_ids``)
    stays in the token ids but not in the text unless ``include_stop_str_in_output`` (EOS
    never: it is special); a stop string ends the text before it (vLLM's defaults)."""
    params = request.params
    num_output = len(request.output_token_ids)
    is_eos = not params.ignore_eos and token in eos_token_ids and num_output > params.min_tokens
    reason: FinishReason | None = None
    if is_eos or (token in params.stop_token_ids and num_output > params.min_tokens):
        reason = FinishReason.STOP
    elif len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= max_model_len:
        reason = FinishReason.LENGTH
    if tokenizer is None:
        return reason, ""
    if reason is FinishReason.STOP and (is_eos or not params.include_stop_str_in_output):
        held = request.detokenizer  # what it held back (a possible stop string's start)
        delta = held.flush() if held is not None else ""
        request.text += delta
        return reason, delta
    detokenizer = request.detokenizer
    if detokenizer is None:  # offline only: served, the gateway decodes
        detokenizer = IncrementalDetokenizer(
            tokenizer,
            request.prompt_token_ids,
            list(params.stop),
            min_tokens=params.min_tokens,
            include_stop_str=params.include_stop_str_in_output,
        )
        request.detokenizer = detokenizer
    delta = detokenizer.add([token])
    if detokenizer.stopped:
        reason = FinishReason.STOP
    if reason is not None:
        delta += detokenizer.flush()
    request.text += delta
    return reason, delta
