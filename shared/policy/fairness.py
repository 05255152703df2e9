"""Per-tenant fairness inside LVF (VTC, OSDI'24, adapted to lag ranking; pure functions).

LVF ranks requests by lag, so a tenant that floods the server gets a share of the starts
proportional to its request count, and every other tenant of the same class waits behind it.
VTC bounds the service difference between backlogged clients by serving the client with the
least service so far first. Here: the engine counts each tenant's recent service (tokens
computed, exponentially decayed: ``Snapshot.tenant_service``); the fair share is the mean over
the tenants with a request in the snapshot; a tenant above ``FAIR_SLACK`` times it is
*over-served*. LVF's head scan then takes the requests of the other tenants first, each group
in L's order (lag within lag), and the over-served tenants' requests with what is left; among
the requests the tail may rotate out (its guards unchanged) it takes the over-served tenants'
first. No tenant with requests waiting gets less than the fair share while another gets more,
and a server with room for everyone (no contention, FCFS) is unchanged. (Until 2026-12-05 the
over-served tenants also kept off the last 10 % of HBM and yielded whatever their residency,
and the others rotated before they lagged: with ``tpot_lag`` those rules cost up to a quarter
of the goodput and bought nothing, bench/fairness.py, docs/benchmarks.md.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from shared.policy.columns import Ints

# Within 50 % of the mean is fair: tenants sending alike are not reordered by noise (1.25 cost
# 9 TTFT points on 8 equal tenants at the ShareGPT knee, 1.5 about 2; docs/scheduling.md).
FAIR_SLACK = 1.5


def over_served(tenants: Ints, tenant_service: Sequence[float]) -> npt.NDArray[np.bool_]:
    """Per row: whether its tenant got more than ``FAIR_SLACK`` x the fair share of recent
    service (all False with fewer than two tenants present, or for rows without a tenant:
    index 0)."""
    over = np.zeros(len(tenants), np.bool_)
    if not len(tenant_service):
        return over
    service = np.asarray(tenant_service, dtype=np.float64)
    known = (tenants > 0) & (tenants < len(service))
    present = np.unique(tenants[known])
    if len(present) < 2:
        return over
    fair = float(service[present].mean())
    over[known] = service[tenants[known]] > FAIR_SLACK * fair
    return over


def fair_groups(indices: Ints, over: npt.NDArray[np.bool_]) -> list[Ints]:
    """``indices`` split into the rows of fairly served tenants, then the over-served ones."""
    if not over[indices].any():
        return [indices]
    return [indices[~over[indices]], indices[over[indices]]]
