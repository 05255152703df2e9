"""Fit a plan computed elsewhere (the control plane, from an older snapshot) to the engine's
current state: drop transitions that no longer apply, then pack the batch locally."""

from __future__ import annotations

from shared.policy.common import pack_schedule, split_snapshot
from shared.policy.types import Plan, RequestState, RequestView, Snapshot


def fit_plan(
    snapshot: Snapshot,
    admit_seqs: list[int],
    resume_seqs: list[int],
    rotate_out_seqs: list[int],
    preempt_seqs: list[int],
) -> Plan:
    """The transitions that are still valid in ``snapshot`` (requests, named by their handle
    ``arrival_seq``, that are still there in the right state, each at most once, within
    ``max_num_seqs``), plus this iteration's batch packed over the resulting running set."""
    named = admit_seqs or resume_seqs or rotate_out_seqs or preempt_seqs
    views = {v.arrival_seq: v for v in snapshot.requests} if named else {}
    taken: set[int] = set()

    def valid(seqs: list[int], state: RequestState) -> list[RequestView]:
        kept = []
        for seq in seqs:
            view = views.get(seq)
            if view is not None and view.state is state and seq not in taken:
                taken.add(seq)
                kept.append(view)
        return kept

    preempt = valid(preempt_seqs, RequestState.RUNNING)
    rotate_out = valid(rotate_out_seqs, RequestState.RUNNING)
    resume = valid(resume_seqs, RequestState.ROTARY)
    admit = valid(admit_seqs, RequestState.WAITING)
    running, _, _ = split_snapshot(snapshot)
    leaving = {v.request_id for v in preempt + rotate_out}
    keep = [v for v in running if v.request_id not in leaving]
    room = max(0, snapshot.max_num_seqs - len(keep))
    resume = resume[:room]
    admit = admit[: max(0, room - len(resume))]
    joining = [v._replace(state=RequestState.RUNNING, resident=False) for v in resume]
    joining += [v._replace(state=RequestState.RUNNING) for v in admit]
    return Plan(
        schedule=pack_schedule(keep + joining, snapshot, snapshot.num_free_hbm_blocks),
        admit_ids=[v.request_id for v in admit],
        resume_ids=[v.request_id for v in resume],
        rotate_out_ids=[v.request_id for v in rotate_out],
        preempt_ids=[v.request_id for v in preempt],
    )
