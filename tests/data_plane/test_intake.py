"""A worker's intake: a poisoned entry (garbage, a wrong type, a hostile size, a refusal that
cannot be written) neither crashes the worker nor holds up the rest of its XREADGROUP batch,
pending entries of an earlier incarnation included; a failed XACK delays nobody; handled
entries leave the stream, so its length stays bounded whatever the traffic."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

from redis.asyncio import Redis
from redis.exceptions import ConnectionError

from shared import streams
from shared.protocol import AbortRequest, SubmitRequest, TokenOutputs, encode
from shared.sampling import SamplingParams
from tests.data_plane.worker_support import (
    finished_outputs,
    push,
    running_worker,
    settings,
    submit,
)

STREAM = streams.worker_requests_stream("w0")
NOT_A_STREAM = streams.gateway_outputs_stream("not-a-stream")  # a refusal's XADD: WRONGTYPE


def _refused_into_a_key_that_is_no_stream() -> SubmitRequest:
    """Refused (600 tokens, the context holds 512), its error output bound for a key that is
    not a stream: writing it fails."""
    return SubmitRequest("refused", [1] * 600, NOT_A_STREAM, time.time(), SamplingParams(4))


async def _push_poison(redis: Redis) -> int:
    """Every kind of poisoned entry; returns how many count as malformed."""
    blobs = [b"", b"\xc1", b"not msgpack at all", encode(submit("cut"))[:-3]]
    blobs.append(b"\xdc\xff\xff" + b"\x90" * 3_000_000)  # 3 MB: over the worker's size limit
    for blob in blobs:
        await redis.xadd(STREAM, {"m": blob})
    await redis.xadd(STREAM, {"wrong-field": b"x"})
    await push(
        redis, TokenOutputs([]), AbortRequest("nobody"), _refused_into_a_key_that_is_no_stream()
    )
    return len(blobs) + 1


async def _assert_stream_drained(redis: Redis) -> None:
    pending = await redis.xpending(STREAM, streams.WORKER_GROUP)
    assert pending["pending"] == 0
    assert await redis.xlen(STREAM) == 0  # acknowledged entries were deleted


def _break_admission_of(engine: Any, request_id: str) -> None:
    """A bug in the engine that only this request hits."""
    real = engine.add_request

    def add_request(rid: str, *args: Any, **kwargs: Any) -> Any:
        if rid == request_id:
            raise KeyError("injected bug")
        return real(rid, *args, **kwargs)

    engine.add_request = add_request


async def test_poisoned_entries_neither_crash_nor_block_their_batch(
    redis_client: Redis, stories_path: Path
) -> None:
    await redis_client.set(NOT_A_STREAM, "a string")
    await push(redis_client, submit("good-0"))
    num_malformed = await _push_poison(redis_client)
    await push(redis_client, submit("bug"), submit("good-1"), submit("good-2"))  # one batch
    async with running_worker(settings(stories_path)) as running:
        _break_admission_of(running.worker.engine, "bug")
        finished = await finished_outputs(redis_client, {"good-0", "bug", "good-1", "good-2"}, 15)
        bug = finished.pop("bug")
        assert bug.error_kind == "engine" and "KeyError" in (bug.error or "")  # no 60 s wait
        assert all(out.error is None for out in finished.values())
        assert not running.task.done()
        assert running.worker.num_malformed == num_malformed
        await _assert_stream_drained(redis_client)


async def test_poisoned_pending_entries_of_an_earlier_incarnation(
    redis_client: Redis, stories_path: Path
) -> None:
    await redis_client.set(NOT_A_STREAM, "a string")
    await redis_client.xgroup_create(STREAM, streams.WORKER_GROUP, id="0", mkstream=True)
    await push(redis_client, submit("good-0"))
    await _push_poison(redis_client)
    await push(redis_client, submit("good-1"))
    # An earlier incarnation read them all, then died before acknowledging any.
    taken: Any = await redis_client.xreadgroup(streams.WORKER_GROUP, "w0", {STREAM: ">"})
    assert len(taken[0][1]) > 2
    async with running_worker(settings(stories_path)) as running:
        finished = await finished_outputs(redis_client, {"good-0", "good-1"}, 15)
        assert all(out.error is None for out in finished.values())
        assert not running.task.done()
        await _assert_stream_drained(redis_client)


class AckFailsOnce(Redis):
    """The real client, except that the first XACK naming ``target`` fails (a blip)."""

    target: ClassVar[bytes | None] = None
    num_failed: ClassVar[int] = 0

    async def xack(self, name: Any, groupname: Any, *ids: Any) -> Any:
        if AckFailsOnce.target in ids and not AckFailsOnce.num_failed:
            AckFailsOnce.num_failed += 1
            raise ConnectionError("injected: the XACK's connection dropped")
        return await super().xack(name, groupname, *ids)


async def test_a_failed_ack_delays_no_request(redis_client: Redis, stories_path: Path) -> None:
    ids = await push(redis_client, *(submit(f"r{i}") for i in range(5)))
    AckFailsOnce.target, AckFailsOnce.num_failed = ids[1], 0
    t_start = time.monotonic()
    async with running_worker(settings(stories_path), AckFailsOnce):
        finished = await finished_outputs(redis_client, {f"r{i}" for i in range(5)}, 15)
        elapsed_s = time.monotonic() - t_start
    assert AckFailsOnce.num_failed == 1
    assert all(out.error is None for out in finished.values())
    await _assert_stream_drained(redis_client)  # acknowledged again, at the stop at the latest
    print(f"5 requests served in {elapsed_s:.2f} s with one XACK failed")


async def test_request_stream_length_stays_bounded(redis_client: Redis, stories_path: Path) -> None:
    request_ids = {f"r{i}" for i in range(300)}
    async with running_worker(settings(stories_path, max_num_seqs=64)):
        for start in range(0, 300, 50):
            batch = [submit(f"r{i}", max_tokens=1) for i in range(start, start + 50)]
            aborts = [AbortRequest(f"gone-{start}-{i}") for i in range(10)]
            await push(redis_client, *batch, *aborts)
        await finished_outputs(redis_client, request_ids, 60)
        length = await redis_client.xlen(STREAM)
    assert length == 0, f"{length} entries left for 360 handled"
    await _assert_stream_drained(redis_client)
