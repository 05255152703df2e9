"""Bounded decoding: a hostile message (2+ MB that msgpack would expand to ~150 MB of objects)
is a ProtocolError raised within a memory bound (tracemalloc's peak); the largest legal
messages still decode."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable

import msgpack
import pytest

from shared.protocol import (
    DEFAULT_LIMITS,
    SCHEMA_VERSION,
    Limits,
    ProtocolError,
    RequestRow,
    RotationPlan,
    StateSnapshot,
    SubmitRequest,
    TokenOutput,
    TokenOutputs,
    decode,
    encode,
)
from shared.protocol.convert import table_from_rows
from shared.protocol.limits import MAX_ERROR_CHARS, MAX_OUTPUTS_PER_MESSAGE, MAX_SPEC_BYTES
from shared.sampling import SamplingParams, StructuredOutput

MB = 1 << 20
ENVELOPE = b"\x83" + b"".join(msgpack.packb(x) for x in ("v", SCHEMA_VERSION, "t", "submit", "d"))


def _array(length: int) -> bytes:
    return b"\xdd" + length.to_bytes(4, "big")


# Each one is over 2 MB; the old decoder built every object before checking the schema.
HOSTILE = {
    "one array of 2.1M empty arrays": ENVELOPE + _array(2_100_000) + b"\x90" * 2_100_000,
    "64 arrays of 33k empty arrays": ENVELOPE
    + _array(64)
    + (_array(33_000) + b"\x90" * 33_000) * 64,
    "40 arrays of 60k ints": ENVELOPE + _array(40) + (_array(60_000) + b"\xe0" * 60_000) * 40,
    "64 arrays of 33k empty maps": ENVELOPE + _array(64) + (_array(33_000) + b"\x80" * 33_000) * 64,
    "one 16 MB binary": ENVELOPE
    + _array(1)
    + b"\xc6"
    + (16 * MB).to_bytes(4, "big")
    + bytes(16 * MB),
}


def _peak(decode_it: Callable[[], object]) -> int:
    """tracemalloc's peak while ``decode_it`` raises ProtocolError (it must)."""
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            decode_it()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_message_is_rejected_within_a_memory_bound(name: str) -> None:
    data = HOSTILE[name]
    assert len(data) > 2 * MB
    peak = _peak(lambda: decode(data))
    assert peak < 12 * MB, f"{name}: decoding peaked at {peak / MB:.1f} MB"
    print(f"{name} ({len(data) / MB:.1f} MB): rejected, peak {peak / MB:.2f} MB")


def test_a_worker_rejects_a_hostile_request_before_decoding_it() -> None:
    limits = Limits.for_prompts(8192)
    for data in HOSTILE.values():
        assert _peak(lambda data=data: decode(data, limits=limits)) < 64 * 1024


def test_a_prompt_of_max_model_len_tokens_decodes_and_one_past_the_bound_does_not() -> None:
    for max_model_len in (512, 131_072):
        limits = Limits.for_prompts(max_model_len)
        prompt = [2**32 - 1 - i for i in range(max_model_len)]  # the widest token ids
        msg = SubmitRequest(
            "r" * 64, prompt, "s" * 64, time.time(), SamplingParams(16, stop_token_ids=(7,) * 64)
        )
        assert decode(encode(msg), limits=limits).prompt_token_ids == prompt
        too_long = SubmitRequest("r", prompt + [1] * 4096, "s", 0.0, SamplingParams(1))
        with pytest.raises(ProtocolError):
            decode(encode(too_long), limits=limits)


def test_a_request_with_everything_at_its_bound_decodes() -> None:
    """A spec of MAX_SPEC_BYTES, a logit_bias and stop ids over the whole vocabulary (what a
    gateway lets through), beside a full context: a worker takes it (a 100 KB spec was
    dropped by the worker after the gateway accepted it)."""
    vocab = 128_256
    prompt = [2**32 - 1] * 8192
    sampling = SamplingParams(
        16,
        stop_token_ids=tuple(range(vocab)),
        logit_bias_ids=tuple(range(vocab)),
        logit_bias_values=(0.5,) * vocab,
        structured=StructuredOutput("choice", "x" * MAX_SPEC_BYTES),
    )
    msg = SubmitRequest("r" * 64, prompt, "s" * 64, time.time(), sampling, tenant="t" * 200)
    decoded = decode(encode(msg), limits=Limits.for_prompts(8192, vocab))
    assert decoded.sampling.structured == sampling.structured


def test_the_largest_legal_messages_decode_within_the_default_limits() -> None:
    outputs = [
        TokenOutput(
            f"cmpl-{i:059d}", 2**20, [2**31], "error", "e" * MAX_ERROR_CHARS, 1, 2.0, 9, 9, "engine"
        )
        for i in range(MAX_OUTPUTS_PER_MESSAGE)
    ]
    assert len(decode(encode(TokenOutputs(outputs)), TokenOutputs).outputs) == len(outputs)
    seqs = list(range(2**40, 2**40 + DEFAULT_LIMITS.max_array_len))
    plan = RotationPlan("w0", "e", 1, 1, "lvf", seqs, [], [], [], False, 1.0, 64)
    assert decode(encode(plan), RotationPlan).admit_seqs == seqs
    big = 2**40
    row = RequestRow("rotary", 1.5, 2.5, 3.5, big, big, big, big, big, big, 1.0, 2.0, False, big)
    rows = [row, RequestRow("running", 1.5, None, None, 1, 0, 0, 0, 0, 0, None, None, True, 1)]
    snapshot = StateSnapshot(
        *("w0", "e", 1, 1.0, table_from_rows(rows * 42_500)),
        *(0, 0, 0, 0, 16, 1 << 20, 2048, 256, 64, 0.05, 5e10, "remote"),
    )
    data = encode(snapshot)
    assert len(data) > 4 * MB  # 85k requests at the widest packing
    assert decode(data, StateSnapshot).requests.num_requests == 85_000


def test_nesting_past_msgpack_stack_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode(ENVELOPE + b"\x91" * 5000 + b"\x00")
