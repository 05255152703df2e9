"""The control plane's B_xfer: a fixed knob, or with ``auto`` the worker's measured link
bandwidth x its iteration time, in blocks."""

from __future__ import annotations

import math
from dataclasses import replace

from control_plane.service import resolve_b_xfer
from shared.policy import Knobs
from shared.protocol import StateSnapshot
from shared.protocol.convert import table_from_rows


def _state_snapshot(link_bytes_per_s: float, iteration_time_s: float) -> StateSnapshot:
    return StateSnapshot(
        "w0", "e1", 7, 1.0, table_from_rows([]), 10, 20, 30, 40, 16, 2 << 20, 2048, 256, 64,
        iteration_time_s, link_bytes_per_s, "remote",
    )  # fmt: skip


def test_resolve_b_xfer_auto_uses_the_measured_link() -> None:
    auto, fixed = Knobs(b_xfer=None), Knobs(b_xfer=300)
    block = 2 << 20
    for rate, t in ((5e10, 0.05), (1.8e11, 0.028), (3e9, 0.0011), (7.7e9, 0.013)):
        msg = _state_snapshot(rate, t)
        assert resolve_b_xfer(auto, msg) == max(1, math.floor(rate * t / block))
        assert resolve_b_xfer(fixed, msg) == 300
    assert resolve_b_xfer(auto, _state_snapshot(5e10, 0.05)) == 1192  # 2.5e9 B / 2 MiB
    assert resolve_b_xfer(auto, _state_snapshot(0.0, 0.05)) == 64  # unmeasured: its budget
    assert resolve_b_xfer(auto, _state_snapshot(1e6, 0.001)) == 1  # at least one block


def test_plan_leaves_the_budget_and_plans_with_what_queued_copies_leave(monkeypatch) -> None:
    """The plan carries the worker's budget (what it sets, so an unmeasured ``auto`` budget
    does not shrink round trip after round trip); LVF plans with the budget less the
    rotation copies queued on the worker, as the worker's own LVF does."""
    import control_plane.service as service

    seen: list[int] = []
    original = service.plan_handles

    def spy(snapshot, knobs):  # type: ignore[no-untyped-def]
        seen.append(snapshot.b_xfer_blocks)
        return original(snapshot, knobs)

    monkeypatch.setattr(service, "plan_handles", spy)
    msg = replace(_state_snapshot(0.0, 0.05), b_xfer_queued_blocks=40)
    for _ in range(3):  # each round trip: the plan's budget becomes the worker's
        plan = service.plan_for(msg, Knobs(policy="lvf", b_xfer=None), 1)
        msg = replace(msg, b_xfer_blocks=plan.b_xfer_blocks)
    fixed = service.plan_for(msg, Knobs(policy="lvf", b_xfer=30), 1)
    assert plan.b_xfer_blocks == 64 and seen[:3] == [24, 24, 24]
    assert fixed.b_xfer_blocks == 30 and seen[3] == 0  # 40 queued use up a budget of 30
