"""The planner's source changes: with steps of a few ms a plan's round trip is outrun every few
iterations and the source flips often (456 log lines in 15 minutes on a busy host); they are
logged at most once a second, with their count."""

from __future__ import annotations

from structlog.testing import capture_logs

from data_plane.planner import HybridPlanner
from shared.policy import Knobs


def test_source_changes_are_logged_at_most_once_a_second_with_their_count() -> None:
    planner = HybridPlanner(Knobs(policy="lvf"), max_age_iterations=4, epoch="e")
    with capture_logs() as logs:
        for iteration in range(200):
            planner._switch("remote" if iteration % 2 else "local", iteration)
    changes = [line for line in logs if line["event"] == "plan_source_changed"]
    assert len(changes) == 1 and changes[0]["num_changes"] == 1
    assert planner.num_source_changes == 199
