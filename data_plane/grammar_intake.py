"""Requests whose structured output is compiling: the compile runs on a thread of its own, and
the request joins the engine, between steps, once its grammar is ready.

Compiling a grammar for the vocabulary took 0.2-0.35 s for a 200-field JSON schema or a long
regex on SmolLM2's 49,152 tokens (xgrammar releases the GIL meanwhile); done where the request
arrived, between two engine steps, it held every running request's next token that long. The
request's arrival time is the gateway's, so its TTFT still counts the wait."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from shared.protocol import SubmitRequest
from shared.sampling import StructuredOutput


class PendingGrammars:
    """``compile`` fills the engine's grammar cache (RequestError when it does not compile);
    ``is_ready`` says whether the cache holds one already."""

    def __init__(
        self,
        compile: Callable[[StructuredOutput], None],
        is_ready: Callable[[StructuredOutput], bool],
    ) -> None:
        self._compile = compile
        self._is_ready = is_ready
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._pending: dict[str, tuple[SubmitRequest, Future[None]]] = {}

    def hold(self, msg: SubmitRequest) -> bool:
        """Whether ``msg`` waits for its grammar (its compile started, or it already waits);
        False: it can join the engine now."""
        structured = msg.sampling.structured
        if msg.request_id in self._pending:
            return True
        if structured is None or self._is_ready(structured):
            return False
        self._pending[msg.request_id] = (msg, self._pool.submit(self._compile, structured))
        return True

    def ready(self) -> list[tuple[SubmitRequest, BaseException | None]]:
        """The held requests whose compile ended (with its error, if it failed), in arrival
        order, no longer held."""
        done = [(rid, msg, f) for rid, (msg, f) in self._pending.items() if f.done()]
        for request_id, _, _ in done:
            del self._pending[request_id]
        return [(msg, future.exception()) for _, msg, future in done]

    def drop(self, request_id: str) -> bool:
        """Forget a held request (aborted while its grammar compiled)."""
        return self._pending.pop(request_id, None) is not None

    def drop_for(self, reply_stream: str) -> list[str]:
        """Forget the requests whose outputs go to ``reply_stream``; returns their ids."""
        ids = [rid for rid, (msg, _) in self._pending.items() if msg.reply_stream == reply_stream]
        for request_id in ids:
            del self._pending[request_id]
        return ids

    def __len__(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
