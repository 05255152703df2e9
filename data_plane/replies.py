"""Where a worker's outputs go: each owned request's reply stream and how many of its tokens
were sent (so a gateway drops what a redelivery repeats), one :class:`TokenOutputs` batch per
reply stream and iteration, and the lifecycle fields waiting to be written. Batches whose write
failed (Redis away or refusing writes for now) are sent again, first, with the next call (the
worker calls even when idle): the gateway drops by index what it already has, so a Redis blip
loses neither a token nor a finish. A stream's batch goes out in messages of at most
``MAX_OUTPUTS_PER_MESSAGE`` outputs (each within the decoders' limits, shared/protocol/limits.py);
a rejected request's error output travels the same way (:meth:`Replies.reject`)."""

from __future__ import annotations

import time
from typing import Any

import structlog
from redis.asyncio import Redis

from data_plane.engine.request import RequestOutput
from shared import streams
from shared.protocol import TokenOutput, TokenOutputs, encode
from shared.protocol.limits import MAX_ERROR_CHARS, MAX_OUTPUTS_PER_MESSAGE

log = structlog.get_logger(__name__)


class Replies:
    def __init__(self) -> None:
        self._reply: dict[str, tuple[str, int]] = {}  # request id -> (stream, tokens sent)
        self._lifecycle: list[tuple[str, dict[str, Any]]] = []  # request id -> fields to set
        self._unsent: dict[str, list[TokenOutput]] = {}  # batches whose write failed

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reply

    def __len__(self) -> int:
        return len(self._reply)

    def request_ids(self) -> list[str]:
        return list(self._reply)

    def reply_streams(self) -> dict[str, str]:
        """Request id -> reply stream, for every owned request."""
        return {request_id: stream for request_id, (stream, _) in self._reply.items()}

    def admit(self, request_id: str, reply_stream: str, fields: dict[str, Any]) -> None:
        """The engine owns ``request_id`` now; its outputs go to ``reply_stream``."""
        self._reply[request_id] = (reply_stream, 0)
        self._lifecycle.append((request_id, fields))

    def reject(self, reply_stream: str, output: TokenOutput) -> None:
        """An output for a request the engine does not own (its refusal), sent with the next
        call of :meth:`send` (and kept while Redis refuses it, as any batch)."""
        self._unsent.setdefault(reply_stream, []).append(output)

    def orphan(self, request_id: str, error: str | None = None) -> None:
        """Forget ``request_id`` (aborted: its gateway is gone); its lifecycle records the
        abort. With ``error``, its reply stream gets that error as its end (a gateway that
        was only stalled fails it at once when it reads again, instead of at a timeout)."""
        entry = self._reply.pop(request_id, None)
        if entry is None:
            return
        fields = {"finished_s": time.time(), "finish_reason": "abort", "orphaned": 1}
        self._lifecycle.append((request_id, fields))
        if error is not None:
            stream, sent = entry
            error = error[:MAX_ERROR_CHARS]
            end = TokenOutput(request_id, sent, [], "error", error, error_kind="orphaned")
            self.reject(stream, end)

    def drop_stream(self, reply_stream: str) -> None:
        """Forget the unsent outputs for ``reply_stream`` (its gateway is gone)."""
        self._unsent.pop(reply_stream, None)

    def token_batches(self, outputs: list[RequestOutput]) -> dict[str, list[TokenOutput]]:
        """Each request's new tokens as a :class:`TokenOutput`, grouped by reply stream; a
        finished request is forgotten and its finish goes to the lifecycle."""
        batches: dict[str, list[TokenOutput]] = {}
        for out in outputs:
            stream, sent = self._reply.get(out.request_id, (None, 0))
            if stream is None:
                continue
            # the engine's count: tokens that never came here leave a gap the gateway sees
            sent = max(sent, out.num_output_tokens - len(out.new_token_ids))
            reason = out.finish_reason.value if out.finish_reason else None
            error = out.error[:MAX_ERROR_CHARS] if out.error and reason != "abort" else None
            msg = TokenOutput(
                out.request_id,
                sent,
                out.new_token_ids,
                reason,
                error,
                t_first_run_s=out.t_first_run_s if sent == 0 else None,
                num_preemptions=out.num_preemptions,
                num_rotations=out.num_rotations,
                error_kind=None if error is None else "engine",  # only a failed step errs
                logprobs=out.logprobs,
                prompt_logprobs=out.prompt_logprobs,
                num_cached_tokens=out.num_cached_tokens if sent == 0 else 0,
            )
            batches.setdefault(stream, []).append(msg)
            if out.finished:
                del self._reply[out.request_id]
                fields = {"finished_s": time.time(), "finish_reason": reason or ""}
                fields |= {"num_rotations": out.num_rotations}
                fields |= {"num_preemptions": out.num_preemptions}
                self._lifecycle.append((out.request_id, fields))
            else:
                self._reply[out.request_id] = (stream, sent + len(out.new_token_ids))
        return batches

    @property
    def has_pending(self) -> bool:
        """Outputs or lifecycle fields still to write (e.g. after a failed write)."""
        return bool(self._unsent or self._lifecycle)

    def take_lifecycle(self) -> list[tuple[str, dict[str, Any]]]:
        """The pending lifecycle fields, taken: the caller writes them (or gives back what it
        could not, :meth:`_keep_lifecycle`)."""
        lifecycle, self._lifecycle = self._lifecycle, []
        return lifecycle

    def _keep_lifecycle(self, entries: list[tuple[str, dict[str, Any]]]) -> None:
        """``entries`` (not written) back before the newer ones, the oldest dropped past
        ``MAX_PENDING_LIFECYCLE``."""
        pending = entries + self._lifecycle
        num_dropped = len(pending) - MAX_PENDING_LIFECYCLE
        if num_dropped > 0:
            log.error("lifecycle_fields_dropped", num_dropped=num_dropped)
            pending = pending[num_dropped:]
        self._lifecycle = pending

    async def send(self, redis: Redis, outputs: list[RequestOutput]) -> None:
        """One batch per reply stream (any unsent one first) and the lifecycle fields, in one
        pipeline. What Redis could not take for now (connection lost, out of memory, read-only
        replica) is kept for the next call, up to ``MAX_UNSENT_OUTPUTS`` per stream; a batch
        that cannot be encoded, or a stream that is not a stream (WRONGTYPE), loses its batch,
        logged, and blocks no other: the gateway then sees a gap."""
        # Taken out before the write: what reject() adds while it is in flight (a request
        # refused between steps) is kept apart and goes with the next call.
        batches, self._unsent = self._unsent, {}
        for stream, batch in self.token_batches(outputs).items():
            batches.setdefault(stream, []).extend(batch)
        encoded = _encoded(batches)
        sending = {stream: batches[stream] for stream in encoded}
        lifecycle = self.take_lifecycle()
        if not encoded and not lifecycle:
            return
        try:
            async with redis.pipeline(transaction=False) as pipe:
                for stream, messages in encoded.items():
                    for data in messages:
                        pipe.xadd(
                            stream, {"m": data}, maxlen=streams.MAXLEN_OUTPUTS, approximate=True
                        )
                _queue_lifecycle(pipe, lifecycle)
                results = await pipe.execute(raise_on_error=False)
        except BaseException:  # connection lost: everything is kept for the next call
            self._unsent = _merged(sending, self._unsent)
            self._keep_lifecycle(lifecycle)
            raise
        counts = [len(messages) for messages in encoded.values()]
        failed = _still_unsent(sending, _per_stream(results, counts))
        self._unsent = _merged(failed, self._unsent)
        hset_results = results[sum(counts) :: 2]
        self._keep_lifecycle(
            [e for e, r in zip(lifecycle, hset_results, strict=True) if _refused_for_now(r)]
        )


MAX_UNSENT_OUTPUTS = 65_536  # per reply stream, kept while Redis refuses writes
MAX_PENDING_LIFECYCLE = 65_536  # requests' lifecycle fields kept while Redis refuses writes


def _queue_lifecycle(pipe: Any, lifecycle: list[tuple[str, dict[str, Any]]]) -> None:
    """Each request's lifecycle fields onto ``pipe``: one HSET, then its EXPIRE."""
    for request_id, fields in lifecycle:
        key = streams.request_lifecycle_key(request_id)
        pipe.hset(key, mapping=fields)
        pipe.expire(key, streams.LIFECYCLE_TTL_S)


def _refused_for_now(result: Any) -> bool:
    """A write Redis refused but may take later (out of memory, a read-only replica); not
    one that can never succeed (the key holds another type: dropped, logged)."""
    if isinstance(result, Exception) and "WRONGTYPE" in str(result):
        log.error("lifecycle_fields_dropped", error=str(result))
        return False
    return isinstance(result, Exception)


def _encoded(batches: dict[str, list[TokenOutput]]) -> dict[str, list[bytes]]:
    """Each batch encoded, in messages of at most ``MAX_OUTPUTS_PER_MESSAGE`` outputs, an
    output with its prompt's log-probabilities in a message of its own (the decoders' limits,
    ``OUTPUT_LIMITS``, hold one such output); one that cannot be (a bug upstream) is dropped,
    logged."""
    encoded = {}
    for stream, batch in batches.items():
        try:
            encoded[stream] = [encode(TokenOutputs(chunk)) for chunk in _messages(batch)]
        except (TypeError, ValueError) as exc:
            log.error("outputs_not_encodable", stream=stream, error=repr(exc))
    return encoded


def _messages(batch: list[TokenOutput]) -> list[list[TokenOutput]]:
    """``batch`` in order, cut into messages (:func:`_encoded`)."""
    messages: list[list[TokenOutput]] = [[]]
    for output in batch:
        alone = output.prompt_logprobs is not None
        if messages[-1] and (alone or len(messages[-1]) >= MAX_OUTPUTS_PER_MESSAGE):
            messages.append([])
        messages[-1].append(output)
        if alone:
            messages.append([])
    return [message for message in messages if message]


def _merged(
    older: dict[str, list[TokenOutput]], newer: dict[str, list[TokenOutput]]
) -> dict[str, list[TokenOutput]]:
    """``older``'s batches with ``newer``'s outputs after them, stream by stream."""
    for stream, batch in newer.items():
        older.setdefault(stream, []).extend(batch)
    return older


def _per_stream(results: list[Any], counts: list[int]) -> list[Any]:
    """One result per stream from one per message: the first error among its messages (its
    batch is then sent again whole: the gateway drops what it already has), else the last."""
    merged, start = [], 0
    for count in counts:
        own = results[start : start + count]
        errors = [r for r in own if isinstance(r, Exception)]
        merged.append(errors[0] if errors else (own[-1] if own else None))
        start += count
    return merged


def _still_unsent(
    batches: dict[str, list[TokenOutput]], results: list[Any]
) -> dict[str, list[TokenOutput]]:
    """The batches whose XADD Redis refused for now, to send again; dropped (logged) when the
    key is not a stream or the backlog passed ``MAX_UNSENT_OUTPUTS``."""
    unsent = {}
    for (stream, batch), result in zip(batches.items(), results, strict=False):
        if not isinstance(result, Exception):
            continue
        permanent = "WRONGTYPE" in str(result) or len(batch) > MAX_UNSENT_OUTPUTS
        log.error(
            "reply_stream_refused_outputs",
            stream=stream,
            error=str(result),
            num_outputs=len(batch),
            kept=not permanent,
        )
        if not permanent:
            unsent[stream] = batch
    return unsent
