"""Compiled grammars held by the worker are bounded: its own cache keeps MAX_CACHED_GRAMMARS,
and xgrammar's compiler keeps none of its own (its default cache has no limit: every distinct
schema a client sent stayed, ~200 KB each on a 49k vocabulary)."""

from __future__ import annotations

import json

import pytest

from data_plane.engine import structured
from data_plane.engine.structured import Grammars
from shared.sampling import StructuredOutput
from shared.tokenizer import ByteTokenizer


def test_distinct_schemas_do_not_pile_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(structured, "MAX_CACHED_GRAMMARS", 4)
    grammars = Grammars(ByteTokenizer(), ByteTokenizer().vocab_size, (2,))
    for i in range(12):
        schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"}}}
        grammars.compile(StructuredOutput("json", json.dumps(schema)))
    assert len(grammars._cache) == 4
    assert grammars._get_compiler().get_cache_size_bytes() == 0
