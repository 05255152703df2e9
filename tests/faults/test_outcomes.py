"""The fault suite's judge (tests/faults/support.py): what a client saw, classified as completed,
clear error or lost, against canned gateway answers (no processes). A gateway that crashes
mid-stream must never pass as a clear error."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from tests.faults.support import Outcome, exact_tokens, stream_one


def _chunk(text: str, finish_reason: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason}
    return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()


def _usage(num_tokens: int) -> bytes:
    usage = {"completion_tokens": num_tokens}
    return f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()


DONE = b"data: [DONE]\n\n"
ERROR_EVENT = b'data: {"error": {"message": "worker w0 lost", "code": "worker_lost"}}\n\n'
OPENAI_503 = b'{"error": {"message": "no worker", "type": "x", "param": null, "code": "no_worker"}}'


class _Body(httpx.AsyncByteStream):
    """A response body: these parts, then (optionally) the connection breaks."""

    def __init__(self, parts: list[bytes], breaks: bool = False) -> None:
        self.parts = parts
        self.breaks = breaks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part
        if self.breaks:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete body")


Answer = Callable[[httpx.Request], httpx.Response]


def _answer(status: int, parts: list[bytes], breaks: bool = False) -> Answer:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, stream=_Body(parts, breaks), headers={"x-request-id": "r1"})

    return handler


async def _outcome(handler: Answer) -> Outcome:
    transport = httpx.MockTransport(handler)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await stream_one(client, 3, timeout_s=10, max_retries=1)


COMPLETE = [_chunk("a"), _chunk("b"), _chunk("c", "length"), _usage(3), DONE]


@pytest.mark.parametrize(
    ("handler", "kind"),
    [
        (_answer(200, COMPLETE), "completed"),
        (_answer(200, [_chunk("a"), ERROR_EVENT, DONE]), "clear"),
        (_answer(503, [OPENAI_503]), "clear"),
        (_answer(429, [OPENAI_503]), "clear"),
        # The gateway crashed mid-stream: the connection breaks. Lost, however it looks.
        (_answer(200, [_chunk("a"), _chunk("b")], breaks=True), "lost"),
        (_answer(200, COMPLETE[:3], breaks=True), "lost"),  # finish seen, no [DONE]
        (_answer(200, [_chunk("a"), _chunk("b")]), "lost"),  # ended without a finish
        (_answer(500, [b"Internal Server Error"]), "lost"),  # no OpenAI error body
        (_answer(502, [b"<html>bad gateway</html>"]), "lost"),
    ],
    ids=[
        "complete",
        "sse-error-event",
        "http-503-openai-body",
        "http-429-openai-body",
        "crash-mid-stream",
        "crash-before-done",
        "no-finish",
        "plain-500",
        "proxy-502",
    ],
)
async def test_outcome_kinds(handler: Answer, kind: str) -> None:
    outcome = await _outcome(handler)
    assert (outcome.completed, outcome.clear_error, outcome.lost) == (
        kind == "completed",
        kind == "clear",
        kind == "lost",
    ), outcome


async def test_a_refused_connection_is_lost_not_clear() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    outcome = await _outcome(refuse)
    assert outcome.lost and outcome.transport and not outcome.clear_error


async def test_exact_tokens_flags_short_duplicated_or_split_streams() -> None:
    good = await _outcome(_answer(200, COMPLETE))
    short = await _outcome(_answer(200, [_chunk("a"), _chunk("b", "length"), _usage(2), DONE]))
    twice = await _outcome(
        _answer(200, [_chunk("a"), _chunk("b", "length"), _chunk("c", "length"), _usage(3), DONE])
    )
    assert exact_tokens([good], 3) == []
    assert len(exact_tokens([short, twice], 3)) == 2
