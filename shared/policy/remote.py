"""Fit a plan computed elsewhere (the control plane, from an older snapshot) to the engine's
current state: drop transitions that no longer apply, let the chosen requests join only with
the room and seats they really have (the accounting LVF itself uses), pack the batch."""

from __future__ import annotations

import numpy as np

from shared.policy.columns import (
    RUNNING_CODE,
    STATE_CODES,
    ColumnarSnapshot,
    Ints,
    columnar_from_snapshot,
    pick_ids,
)
from shared.policy.common import make_chunks
from shared.policy.joining import EMPTY, join_and_pack, running_growth, split_by_dram_room
from shared.policy.types import Knobs, Plan, RequestState, Snapshot


def fit_plan(
    snapshot: Snapshot | ColumnarSnapshot,
    admit_seqs: list[int],
    resume_seqs: list[int],
    rotate_out_seqs: list[int],
    preempt_seqs: list[int],
    knobs: Knobs | None = None,
) -> Plan:
    """The transitions of a remote plan that are still valid in ``snapshot`` (requests, named
    by their handle ``arrival_seq``, still there in the right state, each at most once), and
    this iteration's batch packed over the resulting running set.

    Victims DRAM has no room for, or whose KV is still being copied in, stay running.
    Resumes and admissions are then decided as LVF decides them
    (``shared.policy.joining.join_and_pack``): within the HBM room left after the running
    requests' growth and the blocks the victims free, within the seats, a waiting request
    only if its whole KV fits and it gets a chunk, nobody after a recompute preemption. The
    plan's order (resumes, then admissions) is the rank order.
    """
    if isinstance(snapshot, Snapshot):
        snapshot = columnar_from_snapshot(snapshot)
    columns = snapshot.requests
    named = admit_seqs or resume_seqs or rotate_out_seqs or preempt_seqs
    rows = _rows_by_handle(columns.arrival_seq) if named else {}
    taken: set[int] = set()

    def valid(seqs: list[int], state: RequestState) -> Ints:
        code, kept = STATE_CODES[state], []
        for seq in seqs:
            row = rows.get(seq)
            if row is not None and columns.states[row] == code and row not in taken:
                taken.add(row)
                kept.append(row)
        return np.array(kept, np.int64) if kept else EMPTY

    preempt = valid(preempt_seqs, RequestState.RUNNING)
    rotate_out = valid(rotate_out_seqs, RequestState.RUNNING)
    rotate_out = rotate_out[columns.resident[rotate_out]]
    chosen = np.concatenate(
        (valid(resume_seqs, RequestState.ROTARY), valid(admit_seqs, RequestState.WAITING))
    )
    rotate_out, _ = split_by_dram_room(snapshot, rotate_out, 0)
    running = np.flatnonzero(columns.states == RUNNING_CODE)
    growth = running_growth(snapshot, running)
    moves = join_and_pack(
        snapshot, running, growth, chosen, (rotate_out, preempt), False, knobs or Knobs(), True
    )
    ids = columns.request_ids
    return Plan(
        schedule=make_chunks(pick_ids(ids, moves.batch), moves.tokens),
        admit_ids=pick_ids(ids, moves.admit),
        resume_ids=pick_ids(ids, moves.resume),
        rotate_out_ids=pick_ids(ids, moves.rotate_out),
        preempt_ids=pick_ids(ids, moves.preempt),
    )


def _rows_by_handle(seqs: Ints) -> dict[int, int]:
    return {seq: row for row, seq in enumerate(seqs.tolist())}
