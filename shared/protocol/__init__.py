"""Wire messages between the services: msgpack, typed, versioned; malformed input raises
:class:`ProtocolError` (callers log and skip it). Knob changes travel as a versioned Redis hash
(`shared.knobs`), not as messages."""

from __future__ import annotations

from shared.protocol.codec import SCHEMA_VERSION, ProtocolError, decode, encode
from shared.protocol.messages import (
    AbortRequest,
    RequestRow,
    RequestTable,
    RotationPlan,
    StateSnapshot,
    SubmitRequest,
    TokenOutput,
    TokenOutputs,
    WorkerStatus,
)

__all__ = [
    "SCHEMA_VERSION",
    "AbortRequest",
    "ProtocolError",
    "RequestRow",
    "RequestTable",
    "RotationPlan",
    "StateSnapshot",
    "SubmitRequest",
    "TokenOutput",
    "TokenOutputs",
    "WorkerStatus",
    "decode",
    "encode",
]
