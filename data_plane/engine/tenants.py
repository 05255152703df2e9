"""Each tenant's recent service, counted by the engine for the policy's per-tenant fairness.

The engine is the one owner of this fact: it charges a tenant the tokens it computes for the
tenant's requests (prompt and output alike: a prefill chunk costs what it computes), and
every snapshot carries each tenant's service, decayed exponentially with time constant
``window_s`` so that the recent past counts (a tenant idle for a while starts even again).
Tenants are told apart by a small index (the requests' ``tenant`` view field; 0 is "no
tenant", whose service stays 0); an index is recycled only when its tenant has no request
left and another tenant needs one, so the table stays bounded by the tenants with live
requests (at most ``MAX_TENANTS``; beyond that a new tenant's requests go without one, i.e.
outside fairness).
"""

from __future__ import annotations

import math

from shared.protocol.messages import MAX_TENANTS

DEFAULT_WINDOW_S = 30.0
NO_TENANT = 0


class TenantLedger:
    """Tenant name -> index, live request counts and decayed service per index."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, max_tenants: int = MAX_TENANTS) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.max_tenants = max_tenants
        self._index: dict[str, int] = {}
        self._names: list[str | None] = [None]  # index 0: no tenant
        self._live: list[int] = [0]
        self._service: list[float] = [0.0]
        self._t_s: list[float] = [0.0]  # when each service value was last decayed

    def __len__(self) -> int:
        return len(self._index)

    def enter(self, tenant: str | None, now: float) -> int:
        """The index of a new request's tenant (0: none, or no index free)."""
        if tenant is None:
            return NO_TENANT
        index = self._index.get(tenant)
        if index is None:
            index = self._new_index(tenant, now)
        if index != NO_TENANT:
            self._live[index] += 1
        return index

    def leave(self, index: int) -> None:
        """A request of tenant ``index`` finished."""
        if index != NO_TENANT:
            self._live[index] -= 1

    def charge(self, index: int, num_tokens: int, now: float) -> None:
        """Tenant ``index`` got ``num_tokens`` computed at ``now``."""
        if index != NO_TENANT:
            self._service[index] = self._decayed(index, now) + num_tokens
            self._t_s[index] = now

    def service(self, now: float) -> tuple[float, ...]:
        """Every index's service at ``now`` (empty without tenants; index 0 and a recycled
        one: 0)."""
        if not self._index:
            return ()
        return tuple(self._decayed(i, now) for i in range(len(self._service)))

    def _decayed(self, index: int, now: float) -> float:
        elapsed_s = max(0.0, now - self._t_s[index])
        return self._service[index] * math.exp(-elapsed_s / self.window_s)

    def _new_index(self, tenant: str, now: float) -> int:
        if len(self._names) < self.max_tenants:  # index 0 included
            self._names.append(None)
            self._live.append(0)
            self._service.append(0.0)
            self._t_s.append(now)
            index = len(self._names) - 1
        else:
            idle = [i for i, n in enumerate(self._live) if n == 0 and i != NO_TENANT]
            if not idle:
                return NO_TENANT
            index = min(idle, key=lambda i: self._decayed(i, now))
            old = self._names[index]
            if old is not None:
                del self._index[old]
            self._service[index], self._t_s[index] = 0.0, now
        self._names[index] = tenant
        self._index[tenant] = index
        return index
