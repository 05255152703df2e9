"""Scheduling policies: pure functions from (snapshot, knobs) to a plan. No I/O.

The policy math has exactly one definition each in the product, over request columns (a
view-walking policy calls them on scalars or on columns built from its views;
tests/shared/test_policy_single_definitions.py fails on a second copy):

- VLT (SUPERINFER.md §3): :func:`shared.policy.vlt.vlt_array`;
- blk(r) (§4): :func:`shared.policy.joining.candidate_blocks`;
- the running requests' growth this step: :func:`shared.policy.joining.running_growth`;
- packing a batch: :func:`shared.policy.packing.pack_columns`.

Their one-request-at-a-time statements, which property tests hold them to, live in
tests/shared/policy_reference.py.
"""

from __future__ import annotations

from shared.policy.columns import (
    ColumnarSnapshot,
    RequestColumns,
    columnar_from_snapshot,
    columns_from_views,
)
from shared.policy.registry import (
    POLICY_NAMES,
    PlanHandles,
    make_plan,
    nothing_to_decide,
    plan_handles,
    planned_remotely,
)
from shared.policy.routing import (
    decode_step_s,
    kv_usage,
    least_loaded,
    predicted_lag_s,
    worker_for_key,
)
from shared.policy.types import (
    PAPER_LVF,
    PRIORITY_POLICIES,
    Knobs,
    Plan,
    RequestState,
    RequestView,
    ScheduledChunk,
    Snapshot,
)
from shared.policy.vlt import vlt_array

__all__ = [
    "PAPER_LVF",
    "POLICY_NAMES",
    "PRIORITY_POLICIES",
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
    "decode_step_s",
    "kv_usage",
    "least_loaded",
    "make_plan",
    "nothing_to_decide",
    "plan_handles",
    "planned_remotely",
    "predicted_lag_s",
    "vlt_array",
    "worker_for_key",
]
