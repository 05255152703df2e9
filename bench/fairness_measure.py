"""What bench/fairness.py measures, from a run's timelines (pure functions, no simulation).

A tenant's *service* in the arrival window ``[0, T)``: the prompt tokens of its requests whose
first token came before ``T`` plus the output tokens produced before ``T``. Its *demand*: the
prompt and output tokens of its requests that arrived in the window. Its *fair share*: the
max-min fair division of the window's total service among the tenants by demand (water-filling:
no tenant gets more than it asked for, the rest is split evenly). Jain's index of service /
fair share is 1.0 when every tenant gets its share, 1/n when one tenant gets everything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lab.metrics import RequestTimeline, meets_tpot, meets_ttft
from lab.traces import TraceRequest

LIGHT_PREFIX = "t"  # the light tenants are t1 .. t7


@dataclass(frozen=True, slots=True)
class TenantRun:
    """One run: per tenant its window service and demand (tokens), TTFT hits and requests,
    and good requests (both TTFT and TPOT met)."""

    label: str
    row: dict[str, Any]
    duration_s: float
    service: dict[str, float]
    demand: dict[str, float]
    hits: dict[str, int]
    counts: dict[str, int]
    good: dict[str, int]

    @classmethod
    def of(
        cls,
        label: str,
        trace: Sequence[TraceRequest],
        timelines: Sequence[RequestTimeline],
        row: dict[str, Any],
        duration_s: float,
    ) -> TenantRun:
        """``trace`` sorted by arrival, as the simulator's ``timelines`` are."""
        service: dict[str, float] = {}
        demand: dict[str, float] = {}
        hits: dict[str, int] = {}
        counts: dict[str, int] = {}
        good: dict[str, int] = {}
        for request, timeline in zip(trace, timelines, strict=True):
            name = request.tenant or ""
            counts[name] = counts.get(name, 0) + 1
            hits[name] = hits.get(name, 0) + meets_ttft(timeline)
            good[name] = good.get(name, 0) + is_good(timeline)
            if request.arrival_s < duration_s:
                total = request.input_len + request.output_len
                demand[name] = demand.get(name, 0.0) + total
            service[name] = service.get(name, 0.0) + window_service(request, timeline, duration_s)
        return cls(label, row, duration_s, service, demand, hits, counts, good)

    def attainment(self, tenant: str) -> float:
        """The tenant's TTFT attainment (1.0 when it sent nothing)."""
        count = self.counts.get(tenant, 0)
        return self.hits.get(tenant, 0) / count if count else 1.0

    def goodput(self, tenant: str) -> float:
        """The tenant's requests meeting both SLOs per second of the window."""
        return self.good.get(tenant, 0) / self.duration_s

    def summary(self) -> str:
        parts = [f"{name} {100 * self.attainment(name):.0f}%" for name in sorted(self.counts)]
        return f"goodput {self.row['goodput_rps']:.2f}/s TTFT " + " ".join(parts)


def is_good(timeline: RequestTimeline) -> bool:
    return meets_ttft(timeline) and meets_tpot(timeline)


def window_service(request: TraceRequest, timeline: RequestTimeline, end_s: float) -> float:
    """Tokens computed for ``request`` before ``end_s``: its prompt once its first token came,
    and each output token."""
    times = timeline.token_times_s
    if not times or times[0] >= end_s:
        return 0.0
    return float(request.input_len + sum(1 for t in times if t < end_s))


def max_min_shares(demand: Mapping[str, float], total: float) -> dict[str, float]:
    """Water-filling: ``total`` divided so that no tenant gets more than its demand and the
    tenants that want more all get the same (smallest demands served first)."""
    shares: dict[str, float] = {}
    left = total
    order = sorted(demand, key=lambda t: demand[t])
    for i, tenant in enumerate(order):
        shares[tenant] = min(demand[tenant], left / (len(order) - i))
        left -= shares[tenant]
    return shares


def fair_shares(
    run: TenantRun, alone: TenantRun | None = None
) -> tuple[dict[str, float], dict[str, float]]:
    """(demand, max-min fair share) per tenant with a demand, of the window's total service in
    ``run``. A tenant in ``alone`` (a run of the same arrivals without the others) demands what
    it got there: the tokens of its requests that arrive late in the window cannot all be
    computed before the window ends, by anyone's scheduler."""
    demand = dict(run.demand)
    if alone is not None:
        demand |= {t: min(demand.get(t, 0.0), alone.service.get(t, 0.0)) for t in alone.demand}
    demand = {t: d for t, d in demand.items() if d > 0}
    return demand, max_min_shares(demand, sum(run.service.values()))


def tenant_shares(run: TenantRun, alone: TenantRun | None = None) -> list[float]:
    """Each tenant's window service over its max-min fair share (:func:`fair_shares`)."""
    _, shares = fair_shares(run, alone)
    return [run.service.get(t, 0.0) / share for t, share in shares.items() if share > 0]


def light_entitlement(run: TenantRun, alone: TenantRun) -> float:
    """The share of what the light tenants got alone that max-min fairness entitles them to in
    ``run`` (their fair shares / their demands; 1.0: all of it). Under 1.0 the window's service
    cannot give every light tenant what it got alone without giving the heavy tenant less than
    an equal share: holding the light tenants to their attainment alone is then not fair."""
    demand, shares = fair_shares(run, alone)
    light = [t for t in demand if t.startswith(LIGHT_PREFIX)]
    wanted = sum(demand[t] for t in light)
    return sum(shares[t] for t in light) / wanted if wanted > 0 else 1.0


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2); 1.0 for equal values (or none)."""
    if not values:
        return 1.0
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if squares > 0 else 1.0


def light_attainment(run: TenantRun) -> float:
    """TTFT attainment over every light tenant's requests together."""
    light = [t for t in run.counts if t.startswith(LIGHT_PREFIX)]
    count = sum(run.counts[t] for t in light)
    return sum(run.hits[t] for t in light) / count if count else 1.0
