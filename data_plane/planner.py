"""The worker's planner: under LVF, the control plane's newest plan when it is fresh and made
with the knobs the worker holds, else the same ``shared.policy`` code run locally; the peers'
policies (vllm, swap, edf...) always locally, as their engines plan (a remote plan is fitted
with LVF's joining rules, which are not theirs). It owns the worker's one LVF residency
controller (its value travels in the snapshots: the control plane plans with it). Switches are
logged (at most once a second, with their count). An iteration with nothing to decide
(:func:`~shared.policy.nothing_to_decide`: every request runs, its growth covered) is planned
here whatever the source, and its snapshot need not be sent (:meth:`quiet`)."""

from __future__ import annotations

import time

import structlog

from shared.policy import (
    ColumnarSnapshot,
    Knobs,
    Plan,
    Snapshot,
    make_plan,
    nothing_to_decide,
    planned_remotely,
)
from shared.policy.adaptive import controlled_knobs, residency_controller
from shared.policy.remote import fit_plan
from shared.protocol import RotationPlan

log = structlog.get_logger(__name__)
SOURCE_LOG_INTERVAL_S = 1.0


class HybridPlanner:
    def __init__(self, knobs: Knobs, max_age_iterations: int, epoch: str) -> None:
        self._knobs = knobs
        self.knobs_version = 0  # of ``knobs`` in Redis (0: the worker's flags, not from Redis)
        # LVF's adaptive residency, fed every snapshot (warm when planning turns local).
        self.residency = residency_controller(knobs)
        self.epoch = epoch
        self.max_age_iterations = max_age_iterations
        self.remote: RotationPlan | None = None
        self._remote_applied = True
        self.source = "local"
        self.num_remote = 0
        self.num_local = 0
        self.num_remote_transitions = 0  # state changes taken from remote plans (still valid)
        self.num_quiet = 0  # iterations with nothing to decide (planned here, see quiet())
        self._quiet_iteration = -1  # the last such iteration
        self.num_source_changes = 0
        self._source_logged_s = -SOURCE_LOG_INTERVAL_S  # monotonic, of the last logged change
        self._source_changes_logged = 0

    @property
    def knobs(self) -> Knobs:
        return self._knobs

    @knobs.setter
    def knobs(self, knobs: Knobs) -> None:
        """New knobs (from Redis): a changed residency, policy or ``adaptive_residency``
        restarts the controller at the knob (an operator's pinned value, or the adaptive
        controller's new start and floor), never at a value the old knobs led it to."""
        old = self._knobs
        if (knobs.min_residency_s, knobs.policy, knobs.adaptive_residency) != (
            old.min_residency_s,
            old.policy,
            old.adaptive_residency,
        ):
            self.residency = residency_controller(knobs)
        self._knobs = knobs

    def use_knobs(self, knobs: Knobs, version: int) -> None:
        """The knobs in Redis at ``version``; a plan made with other knobs is dropped."""
        if version != self.knobs_version:
            self.remote = None
        self.knobs, self.knobs_version = knobs, version

    @property
    def min_residency_s(self) -> float:
        """The residency LVF plans with here: the controller's, or the pinned knob."""
        knobs = self._knobs
        return self.residency.value_s if knobs.adaptive_residency else knobs.min_residency_s

    def offer(self, plan: RotationPlan) -> bool:
        """A plan arrived from the control plane; keep it if it is the newest of this
        incarnation, made with the knobs held here. Returns whether it was kept."""
        if plan.epoch != self.epoch or plan.knobs_version != self.knobs_version:
            return False
        if self.remote is None or plan.snapshot_iteration > self.remote.snapshot_iteration:
            self.remote = plan
            self._remote_applied = False
            return True
        return False

    def delta_base(self, iteration: int) -> int | None:
        """The snapshot iteration a snapshot of ``iteration`` may be sent as a delta against:
        that of the newest remote plan while it is fresh (its planner holds that table), else
        None (send the whole table: planning is local, or the plans stopped coming)."""
        remote = self.remote
        if remote is None:
            return None
        base = remote.snapshot_iteration
        return base if 0 < iteration - base <= self.max_age_iterations else None

    def remote_for(self, iteration: int) -> RotationPlan | None:
        """The remote plan iteration ``iteration`` runs under: the newest while it is fresh
        (its transitions, or after them nothing new until the next plan), else None: the
        iteration plans locally. The worker sets B_xfer from this before the step."""
        remote = self.remote
        if remote is None:
            return None
        fresh = 0 <= iteration - remote.snapshot_iteration <= self.max_age_iterations
        return remote if fresh else None

    def quiet(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` had nothing to decide: no planner could have moved a
        request, so its snapshot is worth sending only to keep the worker known."""
        return iteration == self._quiet_iteration

    def __call__(self, snapshot: Snapshot | ColumnarSnapshot) -> Plan:
        """The plan for this iteration (the worker's engine hands columns; views work too)."""
        snapshot, knobs = controlled_knobs(snapshot, self._knobs, self.residency)
        if nothing_to_decide(snapshot):  # only the batch to pack: no plan to wait for
            self.num_quiet += 1
            self._quiet_iteration = snapshot.iteration
            return make_plan(snapshot, knobs)
        remote = self.remote_for(snapshot.iteration) if planned_remotely(knobs) else None
        self._switch("local" if remote is None else "remote", snapshot.iteration)
        if remote is None:
            self.num_local += 1
            return make_plan(snapshot, knobs)
        self.num_remote += 1
        if self._remote_applied:  # already executed: keep running, wait for the next plan
            return fit_plan(snapshot, [], [], [], [], self.knobs)
        self._remote_applied = True
        plan = fit_plan(
            snapshot,
            remote.admit_seqs,
            remote.resume_seqs,
            remote.rotate_out_seqs,
            remote.preempt_seqs,
            self.knobs,
        )
        self.num_remote_transitions += len(plan.admit_ids) + len(plan.resume_ids)
        self.num_remote_transitions += len(plan.rotate_out_ids) + len(plan.preempt_ids)
        return plan

    def _switch(self, source: str, iteration: int) -> None:
        """Logged at most once a second (fast steps outrun a plan's round trip, and the source
        can change every few iterations), with the number of changes since the last line."""
        if source == self.source:
            return
        self.source = source
        self.num_source_changes += 1
        now_s = time.monotonic()
        if now_s - self._source_logged_s >= SOURCE_LOG_INTERVAL_S:
            log.info(
                "plan_source_changed",
                source=source,
                iteration=iteration,
                num_changes=self.num_source_changes - self._source_changes_logged,
            )
            self._source_logged_s = now_s
            self._source_changes_logged = self.num_source_changes
