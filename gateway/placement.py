"""What admitting one request takes from the gateway's shared counts, in one owner: a slot in
its API key's limits (:class:`gateway.limits.KeyLimiter`) and one queued request with its prompt
tokens against the worker it was routed to (:class:`gateway.workers.WorkerDirectory`'s queue
limits and lag estimate). Taken when the request is routed, moved with it, and each part given
back exactly once, whatever order the first token, a move, a failure or the end come in."""

from __future__ import annotations

from gateway.limits import KeyLimiter
from gateway.workers import WorkerDirectory


class Placement:
    """The counts one request holds. The worker whose queue counts it is its route's
    (:class:`gateway.inflight.InFlight` passes it in, and moves both in one step)."""

    def __init__(
        self,
        directory: WorkerDirectory,
        key_limiter: KeyLimiter,
        worker_id: str,
        num_prompt_tokens: int,
        key_id: str | None,
    ) -> None:
        """Take both parts, queued on ``worker_id``; a key over its limits raises (429) and
        takes nothing."""
        if key_id is not None:
            key_limiter.acquire(key_id)
        directory.enqueue(worker_id, num_prompt_tokens)
        self._directory = directory
        self._key_limiter = key_limiter
        self._key_id = key_id
        self.num_prompt_tokens = num_prompt_tokens
        self.queued = True
        self.released = False

    @property
    def key_id(self) -> str | None:
        """The API key the request came with (None: none)."""
        return self._key_id

    def move(self, from_worker_id: str, to_worker_id: str) -> None:
        """The request was resubmitted: count it on ``to_worker_id`` instead."""
        if self.queued:
            self._directory.dequeue(from_worker_id, self.num_prompt_tokens)
            self._directory.enqueue(to_worker_id, self.num_prompt_tokens)

    def started(self, worker_id: str) -> None:
        """The first token arrived: the request left ``worker_id``'s queue."""
        if self.queued:
            self.queued = False
            self._directory.dequeue(worker_id, self.num_prompt_tokens)

    def release(self, worker_id: str) -> None:
        """The request (routed to ``worker_id``) ended, any way: give back what is held."""
        self.started(worker_id)
        if not self.released:
            self.released = True
            if self._key_id is not None:
                self._key_limiter.release(self._key_id)
