"""The engine's tenant ledger: decayed service against the closed form, bounded indexes, and
the engine charging what it computes to the request's tenant (in the simulator's engine)."""

from __future__ import annotations

import math

import pytest

from data_plane.engine.sampling import SamplingParams
from data_plane.engine.tenants import NO_TENANT, TenantLedger
from lab.costmodel import load_profile
from lab.sim.setup import SimSetup, build_parts
from shared.policy import Knobs


def test_service_decays_exponentially_and_charges_add() -> None:
    ledger = TenantLedger(window_s=10.0)
    assert ledger.service(0.0) == ()  # no tenants: nothing to send
    a, b = ledger.enter("a", 0.0), ledger.enter("b", 0.0)
    assert (a, b) == (1, 2) and ledger.enter(None, 0.0) == NO_TENANT
    ledger.charge(a, 100, 0.0)
    ledger.charge(a, 50, 5.0)
    ledger.charge(b, 30, 5.0)
    expected_a = (100 * math.exp(-0.5) + 50) * math.exp(-0.5)  # at t = 10
    assert ledger.service(10.0) == pytest.approx((0.0, expected_a, 30 * math.exp(-0.5)))
    ledger.charge(NO_TENANT, 1000, 10.0)
    assert ledger.service(10.0)[0] == 0.0


def test_indexes_are_bounded_and_recycled_only_when_idle() -> None:
    ledger = TenantLedger(window_s=1.0, max_tenants=3)  # index 0 and two tenants
    a, b = ledger.enter("a", 0.0), ledger.enter("b", 0.0)
    assert ledger.enter("c", 0.0) == NO_TENANT  # both busy: c goes without fairness
    ledger.charge(b, 10, 0.0)
    ledger.leave(a)
    ledger.leave(b)
    c = ledger.enter("c", 1.0)
    assert c == a and len(ledger) == 2  # a is idle with the least service
    assert ledger.enter("a", 1.0) == b  # a comes back: the other idle index
    with pytest.raises(ValueError):
        TenantLedger(window_s=0.0)


def test_the_engine_charges_computed_tokens_to_the_tenant() -> None:
    setup = SimSetup(load_profile("h200-llama3-8b"), 1.0, 0.0)
    engine = build_parts("lvf", Knobs(policy="lvf"), setup).engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("x", list(range(100)), params, t_arr_s=0.0, tenant="acme")
    engine.add_request("y", list(range(40)), params, t_arr_s=0.0)
    while engine.has_unfinished():
        engine.step()
    now = engine.clock()
    service = engine.tenants.service(now)
    window_s = engine.tenants.window_s
    # 100 prompt tokens + 3 decode steps; decay over at most the run's virtual time
    assert 103 * math.exp(-now / window_s) <= service[1] <= 103
    assert service[0] == 0.0 and len(engine.tenants) == 1
    assert engine.snapshot(now).tenant_service == pytest.approx(service)


def test_a_refused_request_is_not_one_of_its_tenants_live_requests() -> None:
    """Every check runs before the tenant is counted: a refused request leaves no live count
    behind (one would keep its tenant's index from ever being recycled)."""
    from data_plane.engine.request import RequestError
    from shared.sampling import StructuredOutput

    setup = SimSetup(load_profile("h200-llama3-8b"), 1.0, 0.0)
    engine = build_parts("lvf", Knobs(policy="lvf"), setup).engine  # no grammar engine
    structured = StructuredOutput("regex", "[ab]+")
    params = SamplingParams(max_tokens=4, temperature=0.0, structured=structured)
    for attempt in range(3):
        with pytest.raises(RequestError, match="structured"):
            engine.add_request(f"r{attempt}", [1, 2, 3], params, t_arr_s=0.0, tenant="acme")
    assert len(engine.tenants) == 0 and not engine.requests
