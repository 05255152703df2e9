"""The one door to the policies, by name (``knobs.policy``): :func:`make_plan` gives a plan
with the batch (the worker planning locally, the simulator); :func:`plan_handles` gives only
the transitions, named by each request's handle (its ``arrival_seq``): what the control plane
sends (the worker fits them to its own state and packs the batch itself)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from shared.policy.columns import (
    RUNNING_CODE,
    ColumnarSnapshot,
    columnar_from_snapshot,
    snapshot_from_columnar,
)
from shared.policy.joining import running_growth
from shared.policy.lvf import lvf, lvf_transitions
from shared.policy.types import POLICY_NAMES, Knobs, Plan, RequestView, Snapshot
from shared.policy.vllm import priority_key, vllm


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


def planned_remotely(knobs: Knobs) -> bool:
    """Whether the control plane plans under ``knobs`` (LVF); the other policies are planned
    by each worker for itself."""
    return knobs.policy == "lvf"


class PlanHandles(NamedTuple):
    """A plan's transitions as request handles (``arrival_seq``), without the batch."""

    admit: list[int]
    resume: list[int]
    rotate_out: list[int]
    preempt: list[int]
    fcfs_fallback: bool


def plan_handles(snapshot: ColumnarSnapshot, knobs: Knobs) -> PlanHandles:
    """The transitions of ``knobs.policy``'s plan for ``snapshot``, as handles. LVF goes from
    row indices straight to handles (no ids, no batch chunks); a view-walking policy's ids are
    mapped to their rows' handles."""
    if knobs.policy == "lvf":
        seqs = snapshot.requests.arrival_seq
        moves = lvf_transitions(snapshot, knobs, with_batch=False)
        rows = (moves.admit, moves.resume, moves.rotate_out, moves.preempt)
        admit, resume, rotate_out, preempt = (seqs[r].tolist() for r in rows)
        return PlanHandles(admit, resume, rotate_out, preempt, moves.fcfs_fallback)
    plan = make_plan(snapshot, knobs)
    columns = snapshot.requests
    seq_of = dict(zip(columns.request_ids, columns.arrival_seq.tolist(), strict=True))
    groups = (plan.admit_ids, plan.resume_ids, plan.rotate_out_ids, plan.preempt_ids)
    admit, resume, rotate_out, preempt = ([seq_of[i] for i in group] for group in groups)
    return PlanHandles(admit, resume, rotate_out, preempt, plan.fcfs_fallback)


def nothing_to_decide(snapshot: Snapshot | ColumnarSnapshot) -> bool:
    """Whether no policy has a transition to make for ``snapshot``: every request runs with
    its KV resident and the free HBM covers the running requests' growth this step (nothing
    waits to be admitted or resumed, so nothing is rotated out for it, and nothing must be
    preempted). The worker then sends no snapshot to plan (tests/shared/test_policy_properties
    holds every policy to this)."""
    if isinstance(snapshot, Snapshot):
        snapshot = columnar_from_snapshot(snapshot)
    columns = snapshot.requests
    if not bool(np.all(columns.states == RUNNING_CODE)) or not bool(np.all(columns.resident)):
        return False
    running = np.arange(len(columns))
    return snapshot.num_free_hbm_blocks >= int(running_growth(snapshot, running).sum())
