"""A request's structured output compiles on a thread of its own (PendingGrammars), so the
serving loop goes on meanwhile: a 400-field schema took ~0.35 s to compile for stories260K's
vocabulary, during which no engine step could run when it compiled where the request arrived."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from data_plane.engine.request import RequestError
from data_plane.engine.structured import Grammars
from data_plane.grammar_intake import PendingGrammars
from shared.protocol import SubmitRequest
from shared.sampling import SamplingParams, StructuredOutput
from shared.tokenizer import load_tokenizer_bundle
from tests.conftest import STORIES_DIR


def _heavy_schema() -> StructuredOutput:
    """400 patterned string fields, a fresh name each time (never in a cache)."""
    fields = {f"k{i}_{uuid.uuid4().hex[:6]}": {"type": "string", "pattern": "[a-z]{3,40}"}
              for i in range(400)}  # fmt: skip
    return StructuredOutput("json", json.dumps({"type": "object", "properties": fields}))


def _submit(request_id: str, structured: StructuredOutput | None) -> SubmitRequest:
    sampling = SamplingParams(max_tokens=4, structured=structured)
    return SubmitRequest(request_id, [1, 5, 6], "out", time.time(), sampling)


@pytest.fixture
def grammars() -> Grammars:
    path = STORIES_DIR / "stories260K.bin"
    if not path.exists():
        pytest.skip("../shared/models/stories260K is not present")
    tokenizer = load_tokenizer_bundle(str(path)).tokenizer
    return Grammars(tokenizer, tokenizer.vocab_size, (2,))


def test_the_loop_runs_while_a_grammar_compiles(grammars: Grammars) -> None:
    pending = PendingGrammars(grammars.compile, grammars.is_compiled)
    try:
        assert not pending.hold(_submit("plain", None))  # nothing to compile: at once
        structured = _heavy_schema()
        assert pending.hold(_submit("r1", structured)) and pending.hold(_submit("r1", structured))
        assert len(pending) == 1
        t_start, gaps, last = time.perf_counter(), [], time.perf_counter()
        ready: list[tuple[SubmitRequest, BaseException | None]] = []
        while not ready:  # the serving loop: it must not stop while the grammar compiles
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            ready = pending.ready()
        compile_s = time.perf_counter() - t_start
        ((msg, error),) = ready
        assert msg.request_id == "r1" and error is None and grammars.is_compiled(structured)
        assert not pending.hold(_submit("r2", structured))  # compiled: joins at once
        print(f"compiled in {compile_s:.3f} s, longest loop gap {max(gaps) * 1e3:.1f} ms")
        assert compile_s > 0.05 and max(gaps) < compile_s / 2
    finally:
        pending.close()


def test_a_grammar_that_does_not_compile_comes_back_with_its_error(grammars: Grammars) -> None:
    pending = PendingGrammars(grammars.compile, grammars.is_compiled)
    try:
        assert pending.hold(_submit("bad", StructuredOutput("regex", "(unclosed")))
        assert pending.hold(_submit("gone", _heavy_schema()))
        assert pending.drop("gone") and not pending.drop("gone")  # aborted while compiling
        deadline = time.monotonic() + 30
        ready: list[tuple[SubmitRequest, BaseException | None]] = []
        while not ready and time.monotonic() < deadline:
            time.sleep(0.01)
            ready = pending.ready()
        ((msg, error),) = ready
        assert msg.request_id == "bad" and isinstance(error, RequestError)
        assert "regex" in str(error) and len(pending) == 0
    finally:
        pending.close()


def test_a_worker_with_a_grammar_compiling_has_unfinished_work(grammars: Grammars) -> None:
    """Its request is acknowledged but not yet in the engine: a drain that looked at the engine
    alone stopped the worker and lost it."""
    from types import SimpleNamespace
    from typing import Any, cast

    from data_plane.service import Worker

    worker = Worker.__new__(Worker)
    worker.engine = cast(Any, SimpleNamespace(has_unfinished=lambda: False))
    worker.grammars = PendingGrammars(grammars.compile, grammars.is_compiled)
    try:
        assert not worker.has_unfinished()
        worker.grammars.hold(_submit("r", _heavy_schema()))
        assert worker.has_unfinished()
    finally:
        worker.grammars.close()
