"""A worker's outputs: one TokenOutputs batch per reply stream and iteration, token indices
that count what was sent, finished requests forgotten with their lifecycle written."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError, OutOfMemoryError, ReadOnlyError, ResponseError

from data_plane.admission import Admission
from data_plane.engine.engine import StepResult
from data_plane.engine.request import FinishReason, RequestOutput
from data_plane.grammar_intake import PendingGrammars
from data_plane.orphans import GatewayWatch
from data_plane.outbox import Outbox
from data_plane.replies import MAX_UNSENT_OUTPUTS, Replies, _still_unsent
from data_plane.reports import WorkerIdentity
from data_plane.service import Worker
from shared import streams
from shared.logprobs import TokenLogprobs
from shared.protocol import DEFAULT_LIMITS, TokenOutput, TokenOutputs, decode
from shared.protocol.convert import stream_messages
from shared.protocol.limits import MAX_ERROR_CHARS, MAX_OUTPUTS_PER_MESSAGE, OUTPUT_LIMITS

GW_A = "superinfer:gateway:a:outputs"
GW_B = "superinfer:gateway:b:outputs"


def _replies() -> Replies:
    replies = Replies()
    replies.admit("r1", GW_A, {"worker_id": "w0"})
    replies.admit("r2", GW_B, {"worker_id": "w0"})
    replies.admit("r3", GW_A, {"worker_id": "w0"})
    return replies


def test_outputs_are_grouped_by_reply_stream_with_running_indices() -> None:
    replies = _replies()
    first = replies.token_batches(
        [RequestOutput("r1", [5, 6], 2), RequestOutput("r2", [7], 1), RequestOutput("r3", [8], 1)]
    )
    assert sorted(first) == [GW_A, GW_B]
    assert [(o.request_id, o.index, o.token_ids) for o in first[GW_A]] == [
        ("r1", 0, [5, 6]),
        ("r3", 0, [8]),
    ]
    second = replies.token_batches([RequestOutput("r1", [9], 3), RequestOutput("nope", [1], 1)])
    assert [(o.request_id, o.index) for o in second[GW_A]] == [("r1", 2)]  # 2 sent before
    assert list(second) == [GW_A]  # a request this worker does not own is skipped


def test_finished_requests_are_forgotten_and_aborts_carry_no_error() -> None:
    replies = _replies()
    done = replies.token_batches(
        [
            RequestOutput("r1", [5], 1, FinishReason.LENGTH),
            RequestOutput("r2", [], 0, FinishReason.ABORT, error="aborted"),
        ]
    )
    assert done[GW_A][0].finish_reason == "length" and "r1" not in replies
    assert done[GW_B][0].error is None and done[GW_B][0].error_kind is None
    assert len(replies) == 1 and replies.request_ids() == ["r3"]


async def test_one_stream_entry_per_gateway_and_the_lifecycle(redis_client: Redis) -> None:
    replies = _replies()
    outputs = [RequestOutput(rid, [1], 1) for rid in ("r1", "r3")]
    await replies.send(redis_client, [*outputs, RequestOutput("r2", [1], 1, FinishReason.STOP)])
    entries_a = await redis_client.xrange(GW_A)
    assert len(entries_a) == 1
    batch = decode(entries_a[0][1][b"m"], TokenOutputs)
    assert [o.request_id for o in batch.outputs] == ["r1", "r3"]
    assert len(await redis_client.xrange(GW_B)) == 1
    finished = await redis_client.hgetall(streams.request_lifecycle_key("r2"))
    assert finished[b"finish_reason"] == b"stop" and finished[b"worker_id"] == b"w0"
    await redis_client.delete(GW_A, GW_B)


async def test_lifecycle_fields_survive_a_redis_blip(redis_client: Redis) -> None:
    """The finish (and admission) fields of a write that lost its connection are written with
    the next call; a key that is not a hash loses its fields (logged), blocking nothing."""
    replies = _replies()
    away = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)  # nothing there
    with pytest.raises(ConnectionError):
        await replies.send(away, [RequestOutput("r2", [1], 1, FinishReason.STOP)])
    await away.aclose()
    assert replies.has_pending
    await replies.send(redis_client, [])
    finished = await redis_client.hgetall(streams.request_lifecycle_key("r2"))
    assert finished[b"finish_reason"] == b"stop" and finished[b"worker_id"] == b"w0"
    assert await redis_client.ttl(streams.request_lifecycle_key("r2")) > 0
    assert not replies.has_pending
    key = streams.request_lifecycle_key("r1")
    await redis_client.set(key, "not a hash")  # HSET refused for good (WRONGTYPE)
    await replies.send(redis_client, [RequestOutput("r1", [1], 1, FinishReason.LENGTH)])
    assert not replies.has_pending and len(await redis_client.xrange(GW_A)) == 1
    await redis_client.delete(GW_A, GW_B, streams.request_lifecycle_key("r2"), key)


class SnapshotWritesFail:
    """The real Redis, except that a pipeline writing a snapshot fails (a blip between two
    calls)."""

    def __init__(self, real: Redis) -> None:
        self.real = real

    def pipeline(self, **kwargs: object) -> object:
        return _FailingSnapshots(self.real.pipeline(**kwargs))  # type: ignore[arg-type]


class _FailingSnapshots:
    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.snapshot = False

    async def __aenter__(self) -> _FailingSnapshots:
        await self.pipe.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pipe.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)

    def xadd(self, stream: str, *args: object, **kwargs: object) -> Any:
        self.snapshot |= streams.worker_of_snapshots_stream(stream) is not None
        return self.pipe.xadd(stream, *args, **kwargs)

    async def execute(self, **kwargs: Any) -> Any:
        if self.snapshot:
            raise ConnectionError("Redis went away")
        return await self.pipe.execute(**kwargs)


async def test_a_refusal_made_while_a_write_is_in_flight_is_sent_next(
    redis_client: Redis,
) -> None:
    """The worker refuses a request (a 400 for its gateway) between steps while the last
    step's outputs are being written: the refusal goes with the next write, never lost (it
    was, and the client waited for a 504)."""
    import asyncio

    replies = _replies()
    sending = asyncio.create_task(replies.send(redis_client, [RequestOutput("r1", [5], 1)]))
    await asyncio.sleep(0)  # the write is in flight
    refusal = TokenOutput("bad", 0, [], "error", "token ids out of range", error_kind="rejected")
    replies.reject(GW_B, refusal)
    replies.reject(GW_A, dataclasses.replace(refusal, request_id="bad2"))
    await sending
    await replies.send(redis_client, [])
    got = {
        stream: [o.request_id for e in await redis_client.xrange(stream) for o in _outs(e)]
        for stream in (GW_A, GW_B)
    }
    await redis_client.delete(GW_A, GW_B)
    assert got == {GW_A: ["r1", "bad2"], GW_B: ["bad"]} and not replies.has_pending


async def _nothing_in_flight() -> None:
    pass


def _outs(entry: Any) -> list[TokenOutput]:
    return decode(entry[1][b"m"], TokenOutputs).outputs


def _outbox(redis: Any) -> Outbox:
    """An outbox whose snapshots encode to fixed bytes, with r1 admitted to GW_A."""
    planner = cast(Any, SimpleNamespace(source="local", quiet=lambda iteration: False))
    replies = Replies()
    replies.admit("r1", GW_A, {"worker_id": "w0"})
    identity = WorkerIdentity("w0", "e1", 64)
    outbox = Outbox(redis, replies, planner, cast(Any, None), identity, snapshot_deltas=False)
    outbox.snapshot_bytes = lambda result, iteration_time_s: b"snapshot"  # type: ignore[method-assign]
    return outbox


async def test_a_failed_snapshot_write_still_sends_the_tokens(redis_client: Redis) -> None:
    outbox = _outbox(SnapshotWritesFail(redis_client))
    snapshot = cast(Any, SimpleNamespace(iteration=1))
    result: Any = StepResult([RequestOutput("r1", [3, 4], 2)], snapshot=snapshot)
    await outbox.publish(result, 0.01)  # sent while the next step would run
    with pytest.raises(ConnectionError):  # the failed write surfaces when the send is awaited
        await outbox.flush()
    (entry,) = await redis_client.xrange(GW_A)
    (out,) = decode(entry[1][b"m"], TokenOutputs).outputs
    assert (out.index, out.token_ids) == (0, [3, 4])  # sent and counted: no silent hole
    await redis_client.delete(GW_A)


async def test_a_step_after_a_failed_send_still_sends_its_tokens(redis_client: Redis) -> None:
    """The failed send's error surfaces in the next step's publish: that step's outputs were
    dropped (a token missing mid-text, finish "length", no error at the client)."""
    outbox = _outbox(SnapshotWritesFail(redis_client))
    for iteration, tokens in ((1, [3, 4]), (2, [5])):
        snapshot = cast(Any, SimpleNamespace(iteration=iteration))
        result: Any = StepResult([RequestOutput("r1", tokens, 1 + iteration)], snapshot=snapshot)
        try:
            await outbox.publish(result, 0.01)
        except ConnectionError:  # the first send's failure, one step later
            assert iteration == 2
    with pytest.raises(ConnectionError):
        await outbox.flush()
    entries = await redis_client.xrange(GW_A)
    outputs = [o for _, fields in entries for o in decode(fields[b"m"], TokenOutputs).outputs]
    assert [(o.index, o.token_ids) for o in outputs] == [(0, [3, 4]), (2, [5])]
    await redis_client.delete(GW_A)


def test_an_output_after_tokens_that_never_came_leaves_a_gap() -> None:
    """Indices follow the engine's count: a lost output is a gap the gateway sees, never a
    shorter text that looks whole."""
    replies = _replies()
    batches = replies.token_batches([RequestOutput("r1", [5], 1)])
    batches = replies.token_batches([RequestOutput("r1", [8], 4)])  # 2 and 3 never came here
    assert [(o.index, o.token_ids) for o in batches[GW_A]] == [(3, [8])]


async def test_outputs_lost_to_a_redis_blip_are_sent_again_first(redis_client: Redis) -> None:
    replies = _replies()
    away = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)  # nothing there
    lost = [RequestOutput("r1", [5], 1), RequestOutput("r2", [6], 1, FinishReason.LENGTH)]
    with pytest.raises(ConnectionError):
        await replies.send(away, lost)
    await away.aclose()
    await replies.send(redis_client, [RequestOutput("r1", [7], 2)])
    (entry_a,) = await redis_client.xrange(GW_A)
    outputs = decode(entry_a[1][b"m"], TokenOutputs).outputs
    assert [(o.index, o.token_ids) for o in outputs] == [(0, [5]), (1, [7])]  # in order
    (entry_b,) = await redis_client.xrange(GW_B)
    (finish,) = decode(entry_b[1][b"m"], TokenOutputs).outputs
    assert finish.finish_reason == "length"  # the finish was not lost with the blip
    await replies.send(redis_client, [])
    assert len(await redis_client.xrange(GW_A)) == 1  # sent once, not again
    await redis_client.delete(GW_A, GW_B)


async def test_a_stream_that_refuses_outputs_blocks_no_other(redis_client: Redis) -> None:
    replies = _replies()
    await redis_client.set(GW_B, "not a stream")  # XADD to it fails with WRONGTYPE
    await replies.send(redis_client, [RequestOutput(r, [1], 1) for r in ("r1", "r2")])
    assert len(await redis_client.xrange(GW_A)) == 1
    await replies.send(redis_client, [RequestOutput("r1", [2], 2)])
    (_, second) = await redis_client.xrange(GW_A)
    assert [o.index for o in decode(second[1][b"m"], TokenOutputs).outputs] == [1]  # no retry
    await redis_client.delete(GW_A, GW_B)


def test_refusals_for_now_are_kept_and_wrong_types_dropped() -> None:
    batches = {GW_A: [TokenOutput("r1", 0, [1])], GW_B: [TokenOutput("r2", 0, [2])], "s": []}
    results = [
        OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'."),
        ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        b"1-0",
        1,  # the lifecycle commands' replies follow the batches'
    ]
    assert _still_unsent(batches, results) == {GW_A: batches[GW_A]}
    backlog = {GW_A: [TokenOutput("r1", i, [1]) for i in range(MAX_UNSENT_OUTPUTS + 1)]}
    assert _still_unsent(backlog, [ReadOnlyError("READONLY replica")]) == {}  # bounded


async def test_an_unencodable_batch_blocks_no_other(redis_client: Redis) -> None:
    replies = _replies()
    bad = RequestOutput("r2", [np.int64(3)], 1)  # type: ignore[list-item]  # a bug upstream
    await replies.send(redis_client, [RequestOutput("r1", [1], 1), bad])
    assert len(await redis_client.xrange(GW_A)) == 1 and not await redis_client.exists(GW_B)
    assert not replies.has_pending  # dropped, not retried forever
    await redis_client.delete(GW_A)


async def test_an_idle_worker_still_sends_what_a_failed_write_left(redis_client: Redis) -> None:
    worker = Worker.__new__(Worker)  # only what an idle _iterate touches
    worker.replies = _replies()
    away = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    with pytest.raises(ConnectionError):  # the last request's finish, while Redis was away
        await worker.replies.send(away, [RequestOutput("r1", [5], 1, FinishReason.STOP)])
    await away.aclose()
    worker.redis = redis_client
    worker.engine = SimpleNamespace(has_unfinished=lambda: False)  # type: ignore[assignment]
    worker.settings = SimpleNamespace(idle_block_ms=50)  # type: ignore[assignment]
    worker.grammars = PendingGrammars(lambda structured: None, lambda structured: True)
    reads: list[int | None] = []

    async def nothing_new(block_ms: int | None) -> tuple[list[Any], list[Any]]:
        reads.append(block_ms)
        return [], []

    async def nothing_to_ack() -> None:
        pass

    worker._fetch = nothing_new  # type: ignore[method-assign]
    worker.intake = cast(Any, SimpleNamespace(ack=nothing_to_ack))
    worker.gateways = GatewayWatch(dead_s=10.0, forget_s=3600.0)
    worker.admission = Admission(
        worker.engine, worker.replies, worker.gateways, worker.grammars, "w0"
    )
    worker._refresh_status = lambda: None  # type: ignore[method-assign]
    worker.knobs = SimpleNamespace(seeded=True, apply=lambda: None)  # type: ignore[assignment]
    worker.outbox = cast(Any, SimpleNamespace(flush=_nothing_in_flight))
    await worker._iterate()
    (entry,) = await redis_client.xrange(GW_A)
    (finish,) = decode(entry[1][b"m"], TokenOutputs).outputs
    assert finish.finish_reason == "stop" and not worker.replies.has_pending
    assert reads[0] == 50  # idle, the read still blocks: retries of a refused write are paced
    await redis_client.delete(GW_A)


async def test_a_large_batch_goes_out_in_messages_within_the_decoders_limits(
    redis_client: Redis,
) -> None:
    replies = Replies()
    num = 2 * MAX_OUTPUTS_PER_MESSAGE + 5
    for i in range(num):
        replies.admit(f"r{i}", GW_A, {"worker_id": "w0"})
    failed = [
        RequestOutput(f"r{i}", [], 0, FinishReason.ERROR, error="x" * 99_999) for i in range(num)
    ]
    await replies.send(redis_client, failed)  # e.g. every request failed by a broken engine
    entries = await redis_client.xrange(GW_A)
    batches = [decode(fields[b"m"], TokenOutputs, DEFAULT_LIMITS).outputs for _, fields in entries]
    assert [len(b) for b in batches] == [MAX_OUTPUTS_PER_MESSAGE, MAX_OUTPUTS_PER_MESSAGE, 5]
    assert {len(out.error or "") for batch in batches for out in batch} == {MAX_ERROR_CHARS}
    await redis_client.delete(GW_A)


async def test_a_refusal_and_an_orphan(redis_client: Redis) -> None:
    replies = _replies()
    replies.reject(GW_B, TokenOutput("no", 0, [], "error", "too long", error_kind="rejected"))
    replies.orphan("r1")  # its gateway died: its outputs go nowhere
    await replies.send(redis_client, [RequestOutput("r1", [], 0, FinishReason.ABORT)])
    (entry,) = await redis_client.xrange(GW_B)
    assert decode(entry[1][b"m"], TokenOutputs).outputs[0].error_kind == "rejected"
    assert not await redis_client.exists(GW_A) and "r1" not in replies
    lifecycle = await redis_client.hgetall(streams.request_lifecycle_key("r1"))
    assert lifecycle[b"orphaned"] == b"1" and lifecycle[b"finish_reason"] == b"abort"
    await redis_client.delete(GW_B)


async def test_an_output_with_its_prompts_logprobs_goes_alone_and_decodes(
    redis_client: Redis,
) -> None:
    """An 8,000-token prompt with prompt_logprobs 20 made a message past the gateway's limits:
    dropped whole, and the requests beside it in the message failed (502 lost_output)."""
    num_positions, top = 8000, 20
    big = TokenLogprobs(
        [-1.0] * num_positions,
        [1] * num_positions,
        [list(range(top))] * num_positions,
        [[-0.5] * top] * num_positions,
    )
    replies = Replies()
    for request_id in ("r1", "r2", "r3"):
        replies.admit(request_id, GW_A, {"worker_id": "w0"})
    await replies.send(
        redis_client,
        [
            RequestOutput("r1", [5], 1),
            RequestOutput("r2", [6], 1, prompt_logprobs=big),
            RequestOutput("r3", [7], 1),
        ],
    )
    response = await redis_client.xread({GW_A: "0-0"})
    messages = [m for _, m in stream_messages(response, TokenOutputs, "bad", OUTPUT_LIMITS)]
    assert [[o.request_id for o in m.outputs] for m in messages if m] == [["r1"], ["r2"], ["r3"]]
    (alone,) = messages[1].outputs if messages[1] else ()
    assert alone.prompt_logprobs is not None and len(alone.prompt_logprobs) == num_positions
    before = [m for _, m in stream_messages(response, TokenOutputs, "bad", DEFAULT_LIMITS)]
    assert before[1] is None  # the limits the gateway read with before
    await redis_client.delete(GW_A)
