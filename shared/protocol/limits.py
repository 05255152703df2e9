"""Bounds on decoding one wire message, derived from the largest legal one, so that a corrupt or
hostile message is a :class:`ProtocolError` that costs about what a legal message costs, never
memory in proportion to what the bytes could expand to (msgpack builds a Python object of up to
72 bytes for each input byte: a 2 MB message of empty arrays was 139 MB).

- The whole message: ``max_bytes``, checked before anything is decoded.
- One array: ``max_array_len`` elements; one string: ``max_str_len`` bytes; one binary:
  ``max_bin_len``; one map: 3 entries (the envelope is the only map on the wire); no ext types.
  msgpack checks each against the declared length before allocating it.
- Everything decoded: ``max_items`` (array elements, arrays and maps, counted as each one
  completes) for a message over ``COUNTED_ABOVE_BYTES``; a smaller one cannot expand far.

What is left: msgpack preallocates up to 10,000 slots (80 KB) per nested array header before
their elements arrive, 1,024 levels deep at most, so a nesting bomb of a few KB peaks at
about 82 MB, transiently (freed when it fails); only a parser of our own would avoid that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from shared.logprobs import MAX_LOGPROBS

BYTES_PER_TOKEN = 5  # a token id < 2**32 packs in at most 5 bytes (uint32)
BYTES_PER_BIAS = BYTES_PER_TOKEN + 9  # a logit_bias entry: its id and its value (float64)
OTHER_FIELDS_BYTES = 64 * 1024  # a message's fields beside its token lists and spec: ids, ...
OTHER_FIELDS_ITEMS = 1024
MIN_TOKENS = 4096  # stop token ids and the like, even beside a short context
# A structured output's spec (a JSON schema, the tools' schemas, a grammar, a choice list): the
# gateway's default body size; a gateway refuses a longer one with a 400 naming its field.
MAX_SPEC_BYTES = 1024 * 1024
COUNTED_ABOVE_BYTES = 64 * 1024  # below: at most ~4.6 MB of objects, not worth counting
# The largest messages the default bounds admit: a TokenOutputs batch (Replies splits a reply
# stream's batch at MAX_OUTPUTS_PER_MESSAGE, ~12 items and ~100 bytes plus its error text
# each), a RotationPlan (its handle lists hold at most the worker's requests) and a
# StateSnapshot (packed columns, ~33 bytes a request, 98 at the widest packing: 8 MiB is over
# 85k requests).
MAX_OUTPUTS_PER_MESSAGE = 1024
MAX_ERROR_CHARS = 512  # a TokenOutput's error text is cut to this


@dataclass(frozen=True, slots=True)
class Limits:
    max_bytes: int
    max_array_len: int
    max_items: int
    max_str_len: int = 64 * 1024

    @classmethod
    def for_prompts(cls, max_model_len: int, vocab_size: int = 0) -> Limits:
        """A worker's request stream. The largest legal SubmitRequest: a prompt of
        ``max_model_len`` tokens, a logit_bias and stop_token_ids over the whole vocabulary
        (a gateway checks both against it and drops repeated stop ids), a spec of
        ``MAX_SPEC_BYTES``."""
        tokens = max(max_model_len, MIN_TOKENS)
        vocab = max(vocab_size, MIN_TOKENS)
        return cls(
            max_bytes=tokens * BYTES_PER_TOKEN
            + vocab * (BYTES_PER_BIAS + BYTES_PER_TOKEN)
            + OTHER_FIELDS_BYTES
            + MAX_SPEC_BYTES,
            max_array_len=max(tokens, vocab),
            max_items=2 * tokens + 3 * vocab + OTHER_FIELDS_ITEMS,
            max_str_len=MAX_SPEC_BYTES,
        )


# Every other stream and key: plans, snapshots, worker statuses.
DEFAULT_LIMITS = Limits(max_bytes=8 * 1024 * 1024, max_array_len=65_536, max_items=131_072)
# The most prompt positions whose log-probabilities one request may ask for (a gateway refuses
# more with a 400 naming prompt_logprobs); with MAX_LOGPROBS each, one output is then ~33 MB.
MAX_PROMPT_LOGPROBS_TOKENS = 131_072
_LOGPROB_POSITION_ITEMS = 2 * (MAX_LOGPROBS + 2)  # its logprob, rank, two top lists
_LOGPROB_POSITION_BYTES = 9 * (MAX_LOGPROBS + 1) + 5 * (MAX_LOGPROBS + 1) + 4  # floats, ids
# A reply stream's messages: 1,024 small outputs, or one output with its prompt's
# log-probabilities alone (data_plane/replies.py puts each such output in its own message).
# Under DEFAULT_LIMITS an 8,000-token prompt with prompt_logprobs 20 made a message no gateway
# could decode: it was dropped, and the other requests in it failed (502 lost_output).
OUTPUT_LIMITS = Limits(
    max_bytes=DEFAULT_LIMITS.max_bytes + MAX_PROMPT_LOGPROBS_TOKENS * _LOGPROB_POSITION_BYTES,
    max_array_len=max(DEFAULT_LIMITS.max_array_len, MAX_PROMPT_LOGPROBS_TOKENS + 1),
    max_items=DEFAULT_LIMITS.max_items + MAX_PROMPT_LOGPROBS_TOKENS * _LOGPROB_POSITION_ITEMS,
)


class LimitExceeded(ValueError):
    pass


class _ItemBudget:
    """Counts what msgpack built (as each array or map completes) and stops it past the
    budget."""

    __slots__ = ("left",)

    def __init__(self, max_items: int) -> None:
        self.left = max_items

    def spend(self, container: Any) -> Any:
        self.left -= len(container) + 1
        if self.left < 0:
            raise LimitExceeded("more items than the largest legal message has")
        return container


def unpack(data: bytes, limits: Limits) -> Any:
    """``data`` unpacked within ``limits``; ValueError (or msgpack's errors) when past them."""
    if len(data) > limits.max_bytes:
        raise LimitExceeded(f"{len(data)} bytes is over the limit of {limits.max_bytes}")
    hooks: dict[str, Any] = {}
    if len(data) > COUNTED_ABOVE_BYTES:
        budget = _ItemBudget(limits.max_items)
        hooks = {"list_hook": budget.spend, "object_hook": budget.spend}
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        max_str_len=limits.max_str_len,
        max_bin_len=limits.max_bytes,
        max_array_len=limits.max_array_len,
        max_map_len=3,
        max_ext_len=0,
        **hooks,
    )
