"""A request in flight through the gateway: one record, added and released by the generation
service.

The record holds everything the gateway knows of one request between its submit and its end:
its :class:`Route` (worker, epoch, wire id, attempt: immutable, replaced whole by a move), its
:class:`~gateway.placement.Placement` (what it counts against the router's queues and its key's
limits), the submit kept for a move until the first token, the output channel and the one
outcome that ends it. :class:`InFlightRequests` is the only index of live requests (by wire
id: the dispatcher routes outputs through it, the service checks workers over it).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from gateway.errors import APIError
from gateway.placement import Placement
from shared.protocol import SubmitRequest, TokenOutput


@dataclass(frozen=True, slots=True)
class Route:
    """Where one attempt of a request runs. ``wire_id`` is the id the worker knows it by:
    the request id, with ``.rN`` appended from the second attempt on (outputs of an earlier
    attempt then find no record)."""

    worker_id: str
    epoch: str
    wire_id: str
    attempt: int = 1

    def next(self, worker_id: str, epoch: str, request_id: str) -> Route:
        attempt = self.attempt + 1
        return Route(worker_id, epoch, f"{request_id}.r{attempt}", attempt)


class Outputs:
    """A bounded channel of token outputs that ends once: :meth:`end` with an error makes
    the next :meth:`get` raise it (outputs still buffered are dropped: the request failed)."""

    def __init__(self, max_buffered: int) -> None:
        self._buffer: deque[TokenOutput] = deque()
        self._max_buffered = max_buffered
        self._waiter: asyncio.Future[None] | None = None
        self.error: APIError | None = None  # the outcome: set once, by end()

    def __len__(self) -> int:
        return len(self._buffer)

    def put(self, msg: TokenOutput) -> bool:
        """Buffer ``msg``; False (nothing buffered) when the buffer is full."""
        if self._max_buffered > 0 and len(self._buffer) >= self._max_buffered:
            return False
        self._buffer.append(msg)
        self._wake()
        return True

    def end(self, error: APIError) -> bool:
        """End the channel with ``error``; False if it had ended already (the first wins)."""
        if self.error is not None:
            return False
        self.error = error
        self._wake()
        return True

    def get_nowait(self) -> TokenOutput | None:
        if self.error is not None:
            raise self.error
        return self._buffer.popleft() if self._buffer else None

    async def wait(self) -> None:
        """Until an output is buffered or the channel ended (nothing is taken)."""
        while not self._buffer and self.error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def get(self) -> TokenOutput:
        while True:
            msg = self.get_nowait()
            if msg is not None:
                return msg
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class InFlight:
    """One request's record (see the module docstring); changed by the generation service (its
    placement, submit, outcome) and the dispatcher (its route on a move, its stream entry id,
    its received count, its outputs' end)."""

    def __init__(
        self,
        request_id: str,
        route: Route,
        placement: Placement,
        max_buffered: int,
        t_route_seen_s: float,
    ) -> None:
        self.request_id = request_id
        self.route = route
        self.placement = placement
        self.outputs = Outputs(max_buffered)
        self.t_route_seen_s = t_route_seen_s  # the route's worker last seen beating (monotonic)
        self.entry_id: bytes | str | None = None  # its entry in the worker's request stream
        self.submit: SubmitRequest | None = None  # kept until the first token, for a move
        self.num_received = 0  # output tokens received on this route (the next index)
        self.released = False  # out of the index: ended for the gateway

    @property
    def num_prompt_tokens(self) -> int:
        return self.placement.num_prompt_tokens

    def started(self) -> None:
        """The first token arrived: it left its worker's queue, and will not move."""
        self.placement.started(self.route.worker_id)
        self.submit = None


class InFlightRequests:
    """The live requests by wire id."""

    def __init__(self) -> None:
        self._by_wire: dict[str, InFlight] = {}

    def __len__(self) -> int:
        return len(self._by_wire)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(list(self._by_wire.values()))

    def get(self, wire_id: str) -> InFlight | None:
        return self._by_wire.get(wire_id)

    def add(self, record: InFlight) -> None:
        if record.route.wire_id in self._by_wire:
            raise ValueError(f"request {record.request_id!r} is already in flight")
        self._by_wire[record.route.wire_id] = record

    def release(self, record: InFlight) -> bool:
        """Take ``record`` out and give back its placement; False if it was out already."""
        if record.released:
            return False
        record.released = True
        self._by_wire.pop(record.route.wire_id, None)
        record.placement.release(record.route.worker_id)
        return True

    def reroute(self, record: InFlight, route: Route) -> Route:
        """Move ``record`` to ``route`` in one step (index, placement, received count);
        returns the old route. Outputs of the old attempt no longer find it."""
        old = record.route
        self._by_wire.pop(old.wire_id, None)
        record.placement.move(old.worker_id, route.worker_id)
        record.route, record.entry_id, record.num_received = route, None, 0
        if not record.released:
            self._by_wire[route.wire_id] = record
        return old
