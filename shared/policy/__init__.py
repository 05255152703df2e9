"""Scheduling policies: pure functions from (snapshot, knobs) to a plan. No I/O."""

from __future__ import annotations

from shared.policy.columns import (
    ColumnarSnapshot,
    RequestColumns,
    columnar_from_snapshot,
    columns_from_views,
)
from shared.policy.registry import POLICY_NAMES, PlanHandles, make_plan, plan_handles
from shared.policy.routing import kv_usage, predicted_lag_s
from shared.policy.types import (
    PAPER_LVF,
    Knobs,
    Plan,
    RequestState,
    RequestView,
    ScheduledChunk,
    Snapshot,
)
from shared.policy.vlt import vlt

__all__ = [
    "PAPER_LVF",
    "POLICY_NAMES",
    "ColumnarSnapshot",
    "Knobs",
    "Plan",
    "PlanHandles",
    "RequestColumns",
    "RequestState",
    "RequestView",
    "ScheduledChunk",
    "Snapshot",
    "columnar_from_snapshot",
    "columns_from_views",
    "kv_usage",
    "make_plan",
    "plan_handles",
    "predicted_lag_s",
    "vlt",
]
