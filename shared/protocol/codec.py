"""msgpack codec for the wire dataclasses: ``{"v": version, "t": type, "d": [fields...]}``.

Fields travel as a positional array (small on the wire); nested message dataclasses likewise.
Decoding checks the version, the type tag, the field count and every field's type against the
dataclass annotations, so a malformed message never reaches service code.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

import msgpack

from shared.protocol.limits import DEFAULT_LIMITS, Limits, unpack

SCHEMA_VERSION = 16  # 2: columnar RequestTable snapshots; 3: TokenOutput.error_kind;
# 4: requests known by handle (arrival_seq) between worker and control plane, no id strings;
# token outputs batched per reply stream and iteration (TokenOutputs); 5: SubmitRequest carries
# the sampling parameters as one nested SamplingParams; 6: snapshots may travel as a delta
# (StateSnapshot.delta: the rows changed since a planned snapshot); 7: snapshots carry the
# worker's LVF residency in force (StateSnapshot.lvf_min_residency_s); 8: SamplingParams carries
# min_tokens, min_p and include_stop_str_in_output; 9: WorkerStatus carries the measured speed
# (prefill_tokens_per_s, decode_step_s); 10: SamplingParams asks for logprobs and
# prompt_logprobs, TokenOutput carries them (shared.logprobs.TokenLogprobs), SamplingParams
# carries structured outputs (shared.sampling.StructuredOutput); 11: requests carry their
# tenant (SubmitRequest.tenant, RequestTable.tenants) and snapshots each tenant's recent
# service (StateSnapshot.tenant_service); 12: requests carry their first token's time and
# their output token count (RequestTable.t_first_s, num_output_tokens: LVF's tpot_lag); 13:
# snapshots carry the worker's B_xfer budget and its queued rotation copies
# (StateSnapshot.b_xfer_blocks, b_xfer_queued_blocks) instead of what is left of the budget
# 14: WorkerStatus carries the B_xfer in force and the measured link bandwidth
# (b_xfer_blocks, link_bytes_per_s), for /metrics; TokenOutput.error_param names the field a
# worker refused a request for; 15: TokenOutput.num_cached_tokens (prompt tokens served from
# the prefix cache, on the first token's message); 16: WorkerStatus carries the decode step's
# fit to its batch size (decode_base_s, decode_s_per_request), for routing, and snapshots the
# worker's cap on a prefill chunk (StateSnapshot.long_prefill_token_threshold). A new message kind
# (AbortReplyStream) keeps the version: no message changed, and a worker that does not know it
# logs and skips it.
T = TypeVar("T")
_REGISTRY: dict[str, type] = {}
_HINTS: dict[type, list[tuple[str, Any]]] = {}


class ProtocolError(ValueError):
    """A message that cannot be decoded into the expected type."""


def message(tag: str) -> typing.Callable[[type[T]], type[T]]:
    """Register a frozen dataclass as a wire message under ``tag``."""

    def register(cls: type[T]) -> type[T]:
        _REGISTRY[tag] = cls
        cls.TYPE = tag  # type: ignore[attr-defined]
        return cls

    return register


def _fields(cls: type) -> list[tuple[str, Any]]:
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
    return _HINTS[cls]


def _to_wire(value: Any) -> Any:
    if type(value) in _SCALARS:
        return value
    if isinstance(value, list | tuple):
        if _SCALARS.issuperset(map(type, value)):
            return list(value)
        return [_to_wire(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [_to_wire(getattr(value, name)) for name, _ in _fields(type(value))]
    return value


_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def encode(msg: Any) -> bytes:
    tag = getattr(type(msg), "TYPE", None)
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a wire message")
    return msgpack.packb({"v": SCHEMA_VERSION, "t": tag, "d": _to_wire(msg)}, use_bin_type=True)


def decode(data: bytes, expected: type[T] | None = None, limits: Limits = DEFAULT_LIMITS) -> T:
    """Decode ``data``; with ``expected`` the message must be of that type. A message past
    ``limits`` (:mod:`shared.protocol.limits`) is a ProtocolError, raised within them."""
    try:
        raw = unpack(data, limits)
    except Exception as exc:  # msgpack raises several exception types on garbage
        raise ProtocolError(f"not msgpack within the limits: {exc!r}") from exc
    if not isinstance(raw, dict) or set(raw) != {"v", "t", "d"}:
        raise ProtocolError("envelope must be a map with keys v, t, d")
    if raw["v"] != SCHEMA_VERSION:
        raise ProtocolError(f"schema_version {raw['v']!r} is not {SCHEMA_VERSION}")
    cls = _REGISTRY.get(raw["t"]) if isinstance(raw["t"], str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {raw['t']!r}")
    if expected is not None and cls is not expected:
        raise ProtocolError(f"expected {expected.TYPE}, got {raw['t']}")  # type: ignore[attr-defined]
    return typing.cast(T, _build(cls, raw["d"], cls.__name__))


_Accept = typing.Callable[[Any], bool]
_PLANS: dict[type, list[tuple[str, Any, _Accept | None]]] = {}
_EXACT = {int: int, str: str, bool: bool, float: float, bytes: bytes}


def _fast_accept(hint: Any) -> _Accept | None:
    """A cheap exact-type test for scalar, optional-scalar and list-of-scalar fields (the
    common case); values it does not accept go through the full check, which converts or
    raises."""
    if hint in _EXACT:
        exact = _EXACT[hint]
        return lambda v: type(v) is exact
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and len(args) == 1 and args[0] in _EXACT:
        only = frozenset({_EXACT[args[0]]})
        return lambda v: type(v) is list and only.issuperset(map(type, v))
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 2:
        (inner,) = [a for a in args if a is not type(None)] or [None]
        if inner in _EXACT and type(None) in args:
            exact = _EXACT[inner]
            return lambda v: v is None or type(v) is exact
    return None


def _plan(cls: type) -> list[tuple[str, Any, _Accept | None]]:
    if cls not in _PLANS:
        _PLANS[cls] = [(name, hint, _fast_accept(hint)) for name, hint in _fields(cls)]
    return _PLANS[cls]


def _build(cls: type, data: Any, path: str) -> Any:
    plan = _plan(cls)
    if not isinstance(data, list) or len(data) != len(plan):
        raise ProtocolError(f"{path}: expected {len(plan)} fields")
    values = [
        value if accept is not None and accept(value) else _check(hint, value, f"{path}.{name}")
        for (name, hint, accept), value in zip(plan, data, strict=True)
    ]
    try:
        return cls(*values)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{path}: {exc}") from exc


def _check(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _check(option, value, path)
            except ProtocolError:
                continue
        raise ProtocolError(f"{path}: {value!r} does not match {hint}")
    if hint is type(None):
        if value is not None:
            raise ProtocolError(f"{path}: expected null")
        return None
    if origin in (list, tuple):
        (item,) = typing.get_args(hint)[:1]
        if not isinstance(value, list):
            raise ProtocolError(f"{path}: expected an array")
        items = [_check(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)  # type: ignore[arg-type]
    return _scalar(hint, value, path)


def _scalar(hint: Any, value: Any, path: str) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{path}: expected a boolean")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ProtocolError(f"{path}: expected an integer")
        return value
    if hint is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ProtocolError(f"{path}: expected a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{path}: expected a string")
        return value
    if hint is bytes:
        if not isinstance(value, bytes):
            raise ProtocolError(f"{path}: expected binary data")
        return value
    raise ProtocolError(f"{path}: unsupported field type {hint}")
