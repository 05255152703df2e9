"""What admitting one request takes from the gateway's shared counts, in one owner: a slot in
its API key's limits (:class:`gateway.limits.KeyLimiter`) and one queued request with its prompt
tokens against the worker it was routed to (:class:`gateway.workers.WorkerDirectory`'s queue
limits and lag estimate). Taken when the request is routed, moved with it, and each part given
back exactly once, whatever order the first token, a move, a failure or the end come in."""

from __future__ import annotations

from gateway.limits import KeyLimiter
from gateway.workers import WorkerDirectory


class Placement:
    def __init__(
        self,
        directory: WorkerDirectory,
        key_limiter: KeyLimiter,
        worker_id: str,
        num_prompt_tokens: int,
        key_id: str | None,
    ) -> None:
        """Take both parts; a key over its limits raises (429) and takes nothing."""
        if key_id is not None:
            key_limiter.acquire(key_id)
        directory.enqueue(worker_id, num_prompt_tokens)
        self._directory = directory
        self._key_limiter = key_limiter
        self._key_id = key_id
        self.worker_id = worker_id  # whose queue counts this request while ``queued``
        self.num_prompt_tokens = num_prompt_tokens
        self.queued = True
        self.released = False

    def move(self, worker_id: str) -> None:
        """The request was resubmitted to ``worker_id``: count it there instead."""
        if self.queued:
            self._directory.dequeue(self.worker_id, self.num_prompt_tokens)
            self._directory.enqueue(worker_id, self.num_prompt_tokens)
        self.worker_id = worker_id

    def started(self) -> None:
        """The first token arrived: the request left its worker's queue."""
        if self.queued:
            self.queued = False
            self._directory.dequeue(self.worker_id, self.num_prompt_tokens)

    def release(self) -> None:
        """The request ended (any way): give back whatever is still held."""
        self.started()
        if not self.released:
            self.released = True
            if self._key_id is not None:
                self._key_limiter.release(self._key_id)
