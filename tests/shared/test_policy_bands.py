"""Priority bands in LVF (``shared/policy/bands.py``): vLLM's ``priority`` (lower first) ranks
requests within each of LVF's tiers; the tail rotates out the worst band first and never a
request of a better band than every one joining. One band (every request's priority equal)
is LVF unchanged (the property tests draw priorities 0-3 for the rest)."""

from __future__ import annotations

from shared.policy import Knobs, RequestView, make_plan
from tests.shared.policy_views import check_plan, running, snap, waiting

# VLT as §3's (no TPOT credit, no residency floor): the tail's order is the VLT's alone
PLAIN_TAIL = Knobs(policy="lvf", tpot_lag=False, min_residency_s=0.0, adaptive_residency=False)


def _with(view: RequestView, priority: int) -> RequestView:
    return view._replace(priority=priority)


def test_the_better_band_joins_first_though_it_lags_less() -> None:
    older = waiting("older", t_arr=0.0, seq=0)  # lags 7.5 s at t = 10
    newer = waiting("newer", t_arr=6.0, seq=1)  # lags 1.5 s
    one_room = {"free": 2, "xfer": 0}
    assert make_plan(snap(older, newer, **one_room), PLAIN_TAIL).admit_ids == ["older"]
    banded = snap(_with(older, 5), _with(newer, 0), **one_room)
    plan = make_plan(banded, PLAIN_TAIL)
    assert plan.admit_ids == ["newer"]
    check_plan(banded, plan)


def _tail(priorities: dict[str, int], joiner_priority: int) -> list[str]:
    """x, y, z running 4 blocks each (VLT -10, -5, -3), no free HBM; w (8 blocks) lags."""
    run = [
        running("x", t_run=0.0, blocks=4, seq=0),
        running("y", t_run=5.0, blocks=4, seq=1),
        running("z", t_run=7.0, blocks=4, seq=2),
    ]
    run = [_with(view, priorities.get(view.request_id, 0)) for view in run]
    w = _with(waiting("w", t_arr=0.0, blocks=8, seq=3), joiner_priority)
    snapshot = snap(*run, w, free=0, xfer=10)
    plan = make_plan(snapshot, PLAIN_TAIL)
    check_plan(snapshot, plan)
    return plan.rotate_out_ids


def test_the_tail_rotates_out_the_worst_band_first() -> None:
    assert _tail({}, 0) == ["x", "y"]  # one band: the longest running first
    assert _tail({"y": 3, "z": 3}, 0) == ["y", "z"]  # x is of a better band: it stays
    assert _tail({"x": 1, "z": 3}, 0) == ["z", "x"]  # band 3, then band 1, y (0) stays


def test_no_room_is_made_at_a_better_band_cost() -> None:
    assert _tail({}, 5) == []  # every running request is of a better band than w
    assert _tail({"z": 5}, 5) == ["z"]  # only its own band (or worse) pays, as far as it can
