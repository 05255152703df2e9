"""The waiting queue and the rotary set, with their requests' policy views and columns kept
up to date.

In overload thousands wait and the policy looks at all of them every iteration. Building a
view per waiting request per iteration was the engine's hot path (the simulator spent 80 % of
a 120 s run there); a :class:`RequestQueue` builds each request's view when it joins and
keeps the views as a list and as numpy columns (for the columnar LVF) in queue order. A join
at either end or a leave anywhere costs one write per column, or one C-level shift of the
columns. What can change while a request waits is its prefix-cache hits: the engine rebuilds
the views of the requests a cache change concerns (:meth:`RequestQueue.refresh`,
:mod:`data_plane.engine.prefix_watch`). Rotary requests change their block counts and
residency while copies complete: the engine reads those three columns afresh
(:meth:`RequestQueue.column_arrays` ``overrides``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from data_plane.engine.request import Request
from shared.policy import RequestState, RequestView
from shared.policy.columns import STATE_CODES
from shared.policy.types import REQUEST_FIELDS

_NAN = float("nan")
# The columns a queue keeps, one per REQUEST_FIELDS field but the ids and the state (the same
# for every request here): (its position in a view, its column, its dtype, None-able).
_STORED = tuple(
    (position, f.column, f.dtype, f.pack == "opt")
    for position, f in enumerate(REQUEST_FIELDS)
    if f.pack not in ("id", "code")
)


class RequestQueue:
    """Requests in one ``state`` in order (``append``, ``appendleft``, ``remove``), with
    :meth:`views` and :meth:`column_arrays` for the policy's snapshot.

    ``make_view`` builds a request's view when it joins (the engine's, which reads the KV
    manager) and when :meth:`refresh` is asked to; the request must not change while it is
    here otherwise (the engine only changes a request after taking it out), except for what
    :meth:`column_arrays` is told to override.
    """

    def __init__(
        self,
        make_view: Callable[[Request], RequestView],
        state: RequestState = RequestState.WAITING,
        capacity: int = 256,
    ) -> None:
        self.state = state
        self._make_view = make_view
        self._requests: list[Request] = []
        self._views: list[RequestView] = []
        self._ids: list[str] = []
        self._arrays: dict[str, np.ndarray[Any, Any]] = {
            column: np.empty(capacity, dtype) for _, column, dtype, _ in _STORED
        }
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def append(self, request: Request) -> None:
        self._insert(len(self._requests), request)

    def appendleft(self, request: Request) -> None:
        self._insert(0, request)

    def remove(self, request: Request) -> None:
        """Take ``request`` out (by identity); ValueError if it is not here."""
        index = self._index(request)
        del self._requests[index], self._views[index], self._ids[index]
        end = len(self._requests) + 1
        for array in self._arrays.values():
            array[index : end - 1] = array[index + 1 : end]

    def refresh(self, request_ids: set[str]) -> None:
        """Rebuild the views (and columns) of the requests in ``request_ids`` in place."""
        for index, request_id in enumerate(self._ids):
            if request_id in request_ids:
                self._write(index, self._make_view(self._requests[index]))

    def views(self) -> list[RequestView]:
        """The requests' views, in order (do not modify the list)."""
        return self._views

    def request_ids(self) -> list[str]:
        """The requests' ids, in order (do not modify the list)."""
        return self._ids

    def column_arrays(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The requests as :class:`~shared.policy.RequestColumns` keyword arguments, in
        order; ``overrides`` replaces whole columns (e.g. fresh block counts). NOT copied:
        views of the queue's buffers, valid until it changes, for a caller that copies them
        at once (:func:`~shared.policy.columns.concat_column_arrays`)."""
        num = len(self._requests)
        arrays: dict[str, Any] = {column: array[:num] for column, array in self._arrays.items()}
        if overrides:
            arrays |= overrides
        arrays["request_ids"] = self._ids
        arrays["states"] = np.full(num, STATE_CODES[self.state], np.uint8)
        return arrays

    def _index(self, request: Request) -> int:
        for index, queued in enumerate(self._requests):  # identity: requests have eq=False
            if queued is request:
                return index
        raise ValueError(f"request {request.request_id!r} is not {self.state.value} here")

    def _insert(self, index: int, request: Request) -> None:
        view = self._make_view(request)
        if view.state is not self.state:
            raise ValueError(
                f"request {request.request_id!r} is {view.state.value}, not {self.state.value}"
            )
        num = len(self._requests)
        if num == self._capacity:
            self._grow(2 * num)
        for array in self._arrays.values():
            if index < num:
                array[index + 1 : num + 1] = array[index:num]
        self._requests.insert(index, request)
        self._views.insert(index, view)
        self._ids.insert(index, view.request_id)
        self._write(index, view)

    def _write(self, index: int, view: RequestView) -> None:
        self._views[index] = view
        arrays = self._arrays
        for position, column, _, optional in _STORED:
            value = view[position]
            arrays[column][index] = _NAN if optional and value is None else value

    def _grow(self, capacity: int) -> None:
        for column, array in self._arrays.items():
            grown = np.empty(capacity, array.dtype)
            grown[: len(array)] = array
            self._arrays[column] = grown
        self._capacity = capacity
