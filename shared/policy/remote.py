"""Fit a plan computed elsewhere (the control plane, from an older snapshot) to the engine's
current state: drop transitions that no longer apply, then pack the batch locally."""

from __future__ import annotations

from shared.policy.common import pack_schedule, split_snapshot
from shared.policy.types import Plan, RequestState, Snapshot


def fit_plan(
    snapshot: Snapshot,
    admit_ids: list[str],
    resume_ids: list[str],
    rotate_out_ids: list[str],
    preempt_ids: list[str],
) -> Plan:
    """The transitions that are still valid in ``snapshot`` (ids in the right state, within
    ``max_num_seqs``), plus this iteration's batch packed over the resulting running set."""
    states = {v.request_id: v.state for v in snapshot.requests}

    def valid(ids: list[str], state: RequestState, taken: set[str]) -> list[str]:
        kept = [i for i in ids if states.get(i) is state and i not in taken]
        taken.update(kept)
        return kept

    taken: set[str] = set()
    plan = Plan(
        preempt_ids=valid(preempt_ids, RequestState.RUNNING, taken),
        rotate_out_ids=valid(rotate_out_ids, RequestState.RUNNING, taken),
        resume_ids=valid(resume_ids, RequestState.ROTARY, taken),
        admit_ids=valid(admit_ids, RequestState.WAITING, taken),
    )
    running, _, _ = split_snapshot(snapshot)
    leaving = set(plan.preempt_ids) | set(plan.rotate_out_ids)
    keep = [v for v in running if v.request_id not in leaving]
    room = max(0, snapshot.max_num_seqs - len(keep))
    plan.resume_ids = plan.resume_ids[:room]
    plan.admit_ids = plan.admit_ids[: max(0, room - len(plan.resume_ids))]
    views = {v.request_id: v for v in snapshot.requests}
    joining = [
        views[i]._replace(state=RequestState.RUNNING, resident=False) for i in plan.resume_ids
    ]
    joining += [views[i]._replace(state=RequestState.RUNNING) for i in plan.admit_ids]
    plan.schedule = pack_schedule(keep + joining, snapshot, snapshot.num_free_hbm_blocks)
    return plan
