"""Priority bands inside LVF: a request's ``priority`` (vLLM's, lower is served first) ranks
it within each tier of the head scan (lagging, not lagging, demoted late): a better band joins
before a worse one, LVF's order holding within a band; the tail rotates out the worst band
first, never a request of a better band than every one it makes room for. Requests of one
priority (every request, unless clients send one) are planned by LVF exactly.

:class:`ScanGroups` is how LVF's scans split the requests they walk: by band (when the
snapshot holds more than one priority), then by tenant (per-tenant fairness, when a tenant
is over-served)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.policy.columns import Ints, RequestColumns
from shared.policy.fairness import fair_groups


def priority_bands(columns: RequestColumns, indices: Ints) -> list[Ints]:
    """``indices`` split by priority, the best (lowest value) first; one band (``[indices]``)
    when they share one priority."""
    if len(indices) < 2:
        return [indices]
    priorities = columns.priority[indices]
    if (priorities == priorities[0]).all():
        return [indices]
    order = np.argsort(priorities, kind="stable")
    ordered, sorted_priorities = indices[order], priorities[order]
    cuts = np.flatnonzero(np.diff(sorted_priorities)) + 1
    return list(np.split(ordered, cuts))


@dataclass(frozen=True, slots=True)
class ScanGroups:
    """The groups a scan takes in turn: ``banded`` (the snapshot holds several priorities)
    splits by band, ``over`` (the rows of over-served tenants, or None) by tenant."""

    banded: bool
    over: np.ndarray | None

    @classmethod
    def of(cls, columns: RequestColumns, over: np.ndarray | None) -> ScanGroups:
        priorities = columns.priority
        return cls(bool(len(priorities)) and priorities.min() != priorities.max(), over)

    def bands(self, columns: RequestColumns, indices: Ints) -> list[Ints]:
        return priority_bands(columns, indices) if self.banded else [indices]

    def head(self, columns: RequestColumns, indices: Ints) -> list[Ints]:
        """The best band first; within a band the fairly served tenants' rows first."""
        over = self.over
        return [
            group
            for band in self.bands(columns, indices)
            for group in ([band] if over is None else fair_groups(band, over))
        ]

    def tail(self, columns: RequestColumns, indices: Ints) -> list[Ints]:
        """The worst band first; within a band the over-served tenants' rows first."""
        over = self.over
        return [
            group
            for band in self.bands(columns, indices)[::-1]
            for group in ([band] if over is None else fair_groups(band, over)[::-1])
        ]

    def displaceable(self, columns: RequestColumns, victims: Ints, chosen: Ints) -> Ints:
        """The victims no better than the best-priority request chosen to join: room is
        never made for worse bands alone at a better band's cost."""
        if not self.banded or not len(victims) or not len(chosen):
            return victims
        best = columns.priority[chosen].min()
        return victims[columns.priority[victims] >= best]
