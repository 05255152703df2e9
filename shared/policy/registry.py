"""The policies by name: ``make_plan(snapshot, knobs)`` dispatches on ``knobs.policy``."""

from __future__ import annotations

from shared.policy.columns import ColumnarSnapshot, snapshot_from_columnar
from shared.policy.lvf import lvf
from shared.policy.types import Knobs, Plan, RequestView, Snapshot
from shared.policy.vllm import priority_key, vllm

POLICY_NAMES = ("vllm", "vllm-priority", "swap", "edf", "lvf")


def make_plan(snapshot: Snapshot | ColumnarSnapshot, knobs: Knobs) -> Plan:
    """The plan for one iteration under ``knobs.policy``. A :class:`ColumnarSnapshot` is
    planned column-wise by LVF (views are turned into columns for it); the other policies walk
    views, built for them from it."""
    name = knobs.policy
    if name == "lvf":
        return lvf(snapshot, knobs)
    if isinstance(snapshot, ColumnarSnapshot):
        snapshot = snapshot_from_columnar(snapshot)
    if name == "vllm":
        return vllm(snapshot)
    if name == "vllm-priority":
        return vllm(snapshot, order_key=priority_key)
    if name == "swap":
        return vllm(snapshot, swap=True)
    if name == "edf":

        def deadline_key(view: RequestView) -> tuple[float, float, int]:
            slo_ttft_s = view.slo_ttft_s if view.slo_ttft_s is not None else knobs.slo_ttft_s
            return (view.t_arr_s + slo_ttft_s, view.t_arr_s, view.arrival_seq)

        return vllm(snapshot, order_key=deadline_key, swap=True)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
