"""Per-tenant fairness inside LVF (VTC, OSDI'24, adapted to lag ranking; pure functions).

LVF ranks requests by lag, so a tenant that floods the server gets a share of the starts
proportional to its request count, and every other tenant of the same class waits behind it.
VTC bounds the service difference between backlogged clients by serving the client with the
least service so far first. Here: the engine counts each tenant's recent service (tokens
computed, exponentially decayed: ``Snapshot.tenant_service``); the fair share is the mean over
the tenants with a request in the snapshot; a tenant above ``FAIR_SLACK`` times it is
*over-served*. LVF's head scan then takes the requests of the other tenants first, each group
in L's order (lag within lag), and the over-served tenants' requests with what is left less
``FAIR_RESERVE`` of HBM (kept free for the other tenants' arrivals); a request of a fairly
served tenant may make room by rotation before it lags (with ``rotate_only_for_lag``, others
wait until they lag); the over-served tenants' running requests may be rotated out whatever
their own lag and residency, and the tail scan takes them first. No tenant with requests
waiting gets less than the fair share while another gets more, and a server with room for
everyone (no contention, FCFS) is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from shared.policy.columns import ColumnarSnapshot, Ints, RequestColumns

# Within 50 % of the mean is fair: tenants sending alike are not reordered by noise (1.25 cost
# 9 TTFT points on 8 equal tenants at the ShareGPT knee, 1.5 about 2; docs/scheduling.md).
FAIR_SLACK = 1.5
# The share of HBM the over-served tenants' requests may not join into: kept for the other
# tenants' arrivals (bench/fairness.py, 1.5x the knee: 0.05 / 0.1 / 0.2 alike, light tenants
# -3 to -4 pts vs alone on two seeds; without it -7.4 and goodput 0.85x at the knee).
FAIR_RESERVE = 0.1


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


def reserve_blocks(snapshot: ColumnarSnapshot) -> int:
    """HBM blocks the over-served tenants' requests may not join into: ``FAIR_RESERVE`` of the
    pool (the free blocks and those the requests hold)."""
    total = snapshot.num_free_hbm_blocks + int(snapshot.requests.num_blocks_hbm.sum())
    return int(FAIR_RESERVE * total)


def yielding_victims(
    columns: RequestColumns, running: Ints, over: npt.NDArray[np.bool_], protect_unserved: bool
) -> npt.NDArray[np.bool_]:
    """Per running row: an over-served tenant's request the tail may rotate out whatever its
    own lag and residency (it holds HBM blocks, is resident, and, with ``protect_unserved``,
    produced a token since it became resident: no request leaves before it was served)."""
    ok = over[running] & (columns.num_blocks_hbm[running] > 0) & columns.resident[running]
    if protect_unserved:
        t_last, t_run = columns.t_last_s[running], columns.t_run_s[running]
        ok &= ~np.isnan(t_last) & (np.isnan(t_run) | (t_last >= t_run))
    result: npt.NDArray[np.bool_] = ok
    return result
