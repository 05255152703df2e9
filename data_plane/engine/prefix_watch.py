"""Which waiting requests a change of the prefix cache concerns.

A waiting request's view counts its prefix-cache hits (computed tokens, shared HBM blocks in
use, DRAM blocks to load), and those change while it waits: a running request caches the
same prefix, an abort releases shared blocks, an allocation evicts them. The hits walk the
request's block keys up to the first miss, so only a change to one of those keys (the hits
and the first missing one) can change the answer. The engine watches exactly those keys per
waiting request and, each iteration, rebuilds the views of the requests whose keys the KV
manager reports changed (:meth:`~data_plane.kv.manager.KVCacheManager.drain_prefix_changes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixWatch:
    """Block key -> the waiting requests whose prefix-hit walk reads it, and back."""

    def __init__(self) -> None:
        self._watchers: dict[int, set[str]] = {}
        self._keys_of: dict[str, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._keys_of)

    def watch(self, request_id: str, keys: Sequence[int]) -> None:
        """``request_id``'s view now depends on ``keys`` (replacing what it watched)."""
        self.forget(request_id)
        if not keys:
            return
        self._keys_of[request_id] = tuple(keys)
        for key in keys:
            self._watchers.setdefault(key, set()).add(request_id)

    def forget(self, request_id: str) -> None:
        """``request_id`` left the waiting queue."""
        for key in self._keys_of.pop(request_id, ()):
            watchers = self._watchers[key]
            watchers.discard(request_id)
            if not watchers:
                del self._watchers[key]

    def affected(self, changed_keys: Iterable[int]) -> set[str]:
        """The requests watching any of ``changed_keys``."""
        found: set[str] = set()
        watchers = self._watchers
        for key in changed_keys:
            ids = watchers.get(key)
            if ids:
                found |= ids
        return found
