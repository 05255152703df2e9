from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.served import Served, embedded_redis, gateway, serve

# The operator's chat template of the tuned gateway (SUPERINFER_CHAT_TEMPLATE, from a file).
TUNED_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{{ m.content }}{% if loop.last %}{% break %}{% endif %} {% endfor %}"
    " with {{ story }}. {{ {'year': strftime_now('%Y')} | tojson(indent=2) | length }}"
    "{% if add_generation_prompt %} Once upon a time{% endif %}"
)
TUNED_KEEPALIVE_S = 0.2


@pytest.fixture(scope="package")
def served(stories_path: Path) -> Iterator[Served]:
    """stories260K behind the whole system; 4 sequences at a time, so tests can fill it."""
    with embedded_redis() as redis_url:
        args = ["--model", str(stories_path), "--block-size", "4", "--max-num-seqs", "4"]
        with serve(args, redis_url) as system:
            yield system


@pytest.fixture(scope="package")
def tuned_gateway(
    served: Served, stories_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A second gateway on the served system (its URL): an SSE keep-alive every 0.2 s,
    TUNED_TEMPLATE as the chat template, tool_choice "auto" with the hermes parser."""
    path = tmp_path_factory.mktemp("chat-template") / "tuned.jinja"
    path.write_text(TUNED_TEMPLATE)
    env = {
        "SUPERINFER_SSE_KEEPALIVE_S": str(TUNED_KEEPALIVE_S),
        "SUPERINFER_CHAT_TEMPLATE": str(path),
        "SUPERINFER_ENABLE_AUTO_TOOL_CHOICE": "1",
        "SUPERINFER_TOOL_CALL_PARSER": "hermes",
    }
    with gateway(served.redis_url, str(stories_path), env) as url:
        yield url
