"""The worker's planner: the control plane's newest plan when it is fresh, else the same
``shared.policy`` code run locally. Switches are logged both ways."""

from __future__ import annotations

import structlog

from shared.policy import ColumnarSnapshot, Knobs, Plan, Snapshot, make_plan
from shared.policy.adaptive import ResidencyController, controlled_knobs
from shared.policy.remote import fit_plan
from shared.protocol import RotationPlan

log = structlog.get_logger(__name__)


class HybridPlanner:
    def __init__(self, knobs: Knobs, max_age_iterations: int, epoch: str) -> None:
        self._knobs = knobs
        # LVF's adaptive residency, fed every snapshot (warm when planning turns local).
        self.residency = ResidencyController(value_s=knobs.min_residency_s)
        self.epoch = epoch
        self.max_age_iterations = max_age_iterations
        self.remote: RotationPlan | None = None
        self._remote_applied = True
        self.source = "local"
        self.num_remote = 0
        self.num_local = 0
        self.num_remote_transitions = 0  # state changes taken from remote plans (still valid)

    @property
    def knobs(self) -> Knobs:
        return self._knobs

    @knobs.setter
    def knobs(self, knobs: Knobs) -> None:
        """New knobs from the control plane: a changed residency restarts the controller
        there (an operator's pinned or starting value)."""
        if knobs.min_residency_s != self._knobs.min_residency_s:
            self.residency = ResidencyController(value_s=knobs.min_residency_s)
        self._knobs = knobs

    @property
    def min_residency_s(self) -> float:
        """The residency LVF plans with here: the controller's, or the pinned knob."""
        knobs = self._knobs
        return self.residency.value_s if knobs.adaptive_residency else knobs.min_residency_s

    def offer(self, plan: RotationPlan) -> bool:
        """A plan arrived from the control plane; keep it if it is the newest of this
        incarnation. Returns whether it was kept."""
        if plan.epoch != self.epoch:
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

    def __call__(self, snapshot: Snapshot | ColumnarSnapshot) -> Plan:
        """The plan for this iteration (the worker's engine hands columns; views work too)."""
        snapshot, knobs = controlled_knobs(snapshot, self._knobs, self.residency)
        remote = self.remote
        fresh = remote is not None and (
            0 <= snapshot.iteration - remote.snapshot_iteration <= self.max_age_iterations
        )
        self._switch("remote" if fresh else "local", snapshot.iteration)
        if remote is None or not fresh:
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
        if source != self.source:
            log.info(
                "plan_source_changed", source=source, previous=self.source, iteration=iteration
            )
            self.source = source
