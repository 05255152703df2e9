"""The fast lane in front of FastAPI: a valid JSON body goes straight to the endpoint, an
APIError gets the registered handler's answer, and everything else reaches the app behind it
with the body replayed untouched."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from gateway.errors import APIError
from gateway.fastlane import FastLane
from tests.served import Served

JSON = {"content-type": "application/json"}


class Body(BaseModel):
    n: int


async def endpoint(body: Body, request: Request) -> Response:
    if body.n < 0:
        raise APIError(400, "negative", param="n", headers={"x-why": "n"})
    return JSONResponse({"n": body.n, "auth": request.headers.get("authorization")})


class App:
    """The app behind the lane: records what it received."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        await JSONResponse({"fallback": True}, status_code=418)(scope, receive, send)


async def _call(
    lane: FastLane, body: bytes, path: str = "/x", content_type: bytes = b"application/json"
) -> tuple[int, dict[str, str], Any]:
    parts = [body[: len(body) // 2], body[len(body) // 2 :]]  # a body in two messages
    messages: list[Message] = [
        {"type": "http.request", "body": parts[0], "more_body": True},
        {"type": "http.request", "body": parts[1], "more_body": False},
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    headers = [(b"content-type", content_type), (b"authorization", b"Bearer k")]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    await lane(scope, receive, send)
    start, body_message = sent[0], sent[1]
    head = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], head, json.loads(body_message["body"])


@pytest.mark.parametrize(
    ("body", "path", "content_type"),
    [
        (b'{"n": "x"}', "/x", b"application/json"),  # invalid: FastAPI's own 400
        (b'{"n": ', "/x", b"application/json"),  # not JSON
        (b"", "/x", b"application/json"),  # empty
        (b'{"n": 1}', "/x", b"text/plain"),  # another content type
        (b'{"n": 1}', "/y", b"application/json"),  # another path
    ],
)
async def test_everything_else_reaches_the_app_with_the_body_replayed(
    body: bytes, path: str, content_type: bytes
) -> None:
    app = App()
    status, _, answer = await _call(
        FastLane(app, {"/x": (Body, endpoint)}), body, path, content_type
    )
    assert (status, answer, app.bodies) == (418, {"fallback": True}, [body])


async def test_a_valid_body_goes_straight_to_the_endpoint() -> None:
    app = App()
    lane = FastLane(app, {"/x": (Body, endpoint)})
    status, _, answer = await _call(
        lane, b'{"n": 7}', content_type=b"application/json; charset=utf-8"
    )
    assert (status, answer, app.bodies) == (200, {"n": 7, "auth": "Bearer k"}, [])
    status, headers, answer = await _call(lane, b'{"n": -1}')
    assert (status, headers["x-why"], answer["error"]["message"]) == (400, "n", "negative")


def test_the_served_app_answers_as_before_around_the_lane(served: Served) -> None:
    url = f"{served.url}/v1/completions"
    too_big = httpx.post(url, content=b" " * 1_100_000, headers=JSON, timeout=30)
    assert too_big.status_code == 413 and "body over" in too_big.json()["error"]["message"]
    invalid = httpx.post(url, json={"prompt": "Once", "max_tokens": "many"}, timeout=30)
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "max_tokens"
    not_json = httpx.post(url, content=b'{"prompt": ', headers=JSON, timeout=30)
    assert not_json.status_code == 400
    as_text = httpx.post(url, content=b'{"prompt": "Once"}', headers={"content-type": "text/plain"})
    assert as_text.status_code == 400
    ok = httpx.post(url, json={"prompt": "Once", "max_tokens": 2, "temperature": 0}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
