"""The control plane's B_xfer: a fixed knob, or with ``auto`` the worker's measured link
bandwidth x its iteration time, in blocks."""

from __future__ import annotations

import math

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
