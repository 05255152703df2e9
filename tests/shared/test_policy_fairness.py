"""Per-tenant fairness inside LVF (shared/policy/fairness.py) on hand-built snapshots: which
tenant is over-served, and whose waiting request starts when only one fits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from shared.policy import Knobs, Snapshot, columnar_from_snapshot, make_plan
from shared.policy.fairness import (
    FAIR_SLACK,
    fair_groups,
    over_served,
)
from tests.shared.policy_views import running, snap, waiting

FAIR = Knobs(policy="lvf", tenant_fairness=True)
UNFAIR = Knobs(policy="lvf", tenant_fairness=False)


def test_over_served_against_the_mean_of_the_tenants_present() -> None:
    tenants = np.array([1, 1, 2, 3, 0, 1])
    service = (0.0, 900.0, 50.0, 50.0, 5000.0)  # tenant 4 has no request here: not counted
    # mean over tenants 1, 2, 3 = 1000 / 3; 900 > 1.5 * 333: tenant 1 is over-served
    assert over_served(tenants, service).tolist() == [True, True, False, False, False, True]
    close = (0.0, 490.0, 260.0, 250.0)  # 490 <= 1.5 * 333.3: within the slack
    assert not over_served(tenants[:4], close).any() and FAIR_SLACK == 1.5
    assert not over_served(np.array([1, 1]), (0.0, 1e6)).any()  # one tenant: nothing to share
    assert not over_served(tenants, ()).any()
    groups = fair_groups(np.arange(6), over_served(tenants, service))
    assert [g.tolist() for g in groups] == [[2, 3, 4], [0, 1, 5]]


def _contended(service: tuple[float, ...]):
    """Room for one 2-block request: the heavy tenant's (1) has waited longest."""
    busy = running("busy", t_run=1.0, blocks=4)
    heavy = waiting("heavy", t_arr=1.0, seq=1)._replace(tenant=1)
    light = waiting("light", t_arr=4.0, seq=2)._replace(tenant=2)
    snapshot = snap(busy, heavy, light, free=2)
    return replace(snapshot, tenant_service=service)


def test_the_light_tenant_starts_first_when_the_heavy_one_is_over_served() -> None:
    snapshot = _contended((0.0, 8000.0, 500.0))
    for s in (snapshot, columnar_from_snapshot(snapshot)):
        assert make_plan(s, UNFAIR).admit_ids == ["heavy"]  # LVF: largest lag first
        assert make_plan(s, FAIR).admit_ids == ["light"]
    even = _contended((0.0, 600.0, 500.0))  # both within the fair share: LVF's order
    assert make_plan(even, FAIR).admit_ids == ["heavy"]
    no_tenants = replace(even, tenant_service=())
    assert make_plan(no_tenants, FAIR).admit_ids == ["heavy"]


def test_the_over_served_tenant_still_gets_what_is_left() -> None:
    snapshot = replace(_contended((0.0, 8000.0, 500.0)), num_free_hbm_blocks=4)
    assert sorted(make_plan(snapshot, FAIR).admit_ids) == ["heavy", "light"]


def test_the_tail_rotates_the_over_served_tenant_out_first() -> None:
    """A lagging light request needs room: LVF's tail would rotate out the request running
    longest (the light tenant's); with fairness, the over-served tenant's goes."""
    light_run = running("light_run", t_run=1.0, blocks=2)._replace(tenant=2)
    heavy_run = running("heavy_run", t_run=5.0, blocks=2)._replace(tenant=1)
    lagging = waiting("w", t_arr=1.0, blocks=2, seq=3)._replace(tenant=2)
    snapshot = replace(
        snap(light_run, heavy_run, lagging, free=0, xfer=100), tenant_service=(0.0, 9e3, 1e3)
    )
    assert make_plan(snapshot, UNFAIR).rotate_out_ids == ["light_run"]
    fair = make_plan(snapshot, FAIR)
    assert fair.rotate_out_ids == ["heavy_run"]  # w joins once its blocks are copied out


def _heavy_resident_briefly(t_last: float) -> Snapshot:
    """The heavy tenant's request started 0.2 s ago (inside ``min_residency_s``); a light
    request lags with no free HBM and the link can move 100 blocks."""
    heavy_run = running("heavy_run", t_run=9.8, blocks=2, t_last=t_last)._replace(tenant=1)
    lagging = waiting("w", t_arr=1.0, blocks=2, seq=3)._replace(tenant=2)
    return replace(snap(heavy_run, lagging, free=0, xfer=100), tenant_service=(0.0, 9e3, 1e3))


def test_the_over_served_tenant_is_owed_no_residency_and_makes_no_room() -> None:
    """The tenant over its share waits (VTC's rule): its request resident for 0.2 s is rotated
    out for a lagging light request (LVF's residency guard keeps it without fairness: with
    the guard, the light tenants lost 5-11 more points at 1.5x the knee, bench/fairness.py);
    its own lagging waiting request makes no room, it joins within free HBM, so the light
    tenant's big request that fits only into the last blocks is passed over as in LVF."""
    snapshot = _heavy_resident_briefly(t_last=9.9)
    assert make_plan(snapshot, UNFAIR).rotate_out_ids == []
    assert make_plan(snapshot, FAIR).rotate_out_ids == ["heavy_run"]
    light_run = running("light_run", t_run=1.0, blocks=90)._replace(tenant=2)
    heavy = waiting("heavy", t_arr=1.0, blocks=2, seq=1)._replace(tenant=1)
    big = waiting("big", t_arr=4.0, blocks=14, seq=2)._replace(tenant=2)
    roomless = replace(snap(light_run, heavy, big, free=10), tenant_service=(0.0, 8e3, 5e2))
    assert make_plan(roomless, FAIR).admit_ids == make_plan(roomless, UNFAIR).admit_ids
