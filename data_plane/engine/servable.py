"""Whether a request can ever be served by an engine: the checks :meth:`Engine.add_request`
makes before queueing it (a :class:`RequestError` naming the field at fault)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from data_plane.engine.request import RequestError
from data_plane.engine.sampling import SamplingParams

if TYPE_CHECKING:  # the KV layer holds torch tensors; the checks need no torch
    from data_plane.kv.tiered import KVCacheManager


def check_servable(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    kv: KVCacheManager,
    max_model_len: int,
    vocab_size: int | None,
) -> None:
    """Raise :class:`RequestError` for a prompt or parameters no iteration could serve. A
    request of one token (an echo-only scoring: lm-eval's loglikelihood) may fill the context:
    the token it samples is never fed back, so its KV is never written."""
    if not prompt_token_ids:
        raise RequestError("prompt is empty (it needs at least one token, e.g. BOS)", "prompt")
    one_token = params.max_tokens == 1
    if len(prompt_token_ids) >= max_model_len + one_token:
        room = "" if one_token else " (prompt + at least one generated token)"
        raise RequestError(
            f"prompt has {len(prompt_token_ids)} tokens; the context holds {max_model_len}{room}",
            "prompt",
        )
    if vocab_size is not None:
        _check_ids(prompt_token_ids, vocab_size, "prompt", "prompt token ids")
        _check_ids(params.stop_token_ids, vocab_size, "stop_token_ids", "stop_token_ids")
        _check_ids(params.logit_bias_ids, vocab_size, "logit_bias", "logit_bias token ids")
    needed = kv.blocks_for(len(prompt_token_ids) + (not one_token))
    if needed > kv.num_hbm_blocks:
        raise RequestError(
            f"prompt needs {needed} KV blocks; the HBM pool has {kv.num_hbm_blocks}", "prompt"
        )


def _check_ids(token_ids: Sequence[int], vocab_size: int, field: str, what: str) -> None:
    if not all(0 <= t < vocab_size for t in token_ids):
        raise RequestError(f"{what} must be in 0..{vocab_size - 1}", field)
