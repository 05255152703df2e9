"""Wire messages between the services: msgpack, typed, versioned; malformed input raises
:class:`ProtocolError` (callers log and skip it). Knob changes travel as a versioned Redis hash
(`shared.knobs`), not as messages."""

from __future__ import annotations

from shared.protocol.codec import SCHEMA_VERSION, ProtocolError, decode, encode
from shared.protocol.limits import DEFAULT_LIMITS, Limits
from shared.protocol.messages import (
    AbortReplyStream,
    AbortRequest,
    RotationPlan,
    StateSnapshot,
    SubmitRequest,
    TokenOutput,
    TokenOutputs,
    WorkerStatus,
)
from shared.protocol.table import RequestRow, RequestTable, TableDelta

__all__ = [
    "DEFAULT_LIMITS",
    "SCHEMA_VERSION",
    "AbortReplyStream",
    "AbortRequest",
    "Limits",
    "ProtocolError",
    "RequestRow",
    "RequestTable",
    "RotationPlan",
    "StateSnapshot",
    "SubmitRequest",
    "TableDelta",
    "TokenOutput",
    "TokenOutputs",
    "WorkerStatus",
    "decode",
    "encode",
]
