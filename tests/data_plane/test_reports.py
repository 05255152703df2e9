"""The worker's reports (data_plane/reports.py through Worker): a snapshot value that cannot
travel is logged and the snapshot skipped, the worker goes on; the snapshot carries the LVF
residency in force; the status counts the waiting tokens not yet computed."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from data_plane.engine.config import EngineConfig
from data_plane.engine.engine import StepResult
from data_plane.engine.llm import build_engine
from data_plane.engine.sampling import SamplingParams
from data_plane.kv.tiered import KVCacheManager
from data_plane.models import load_model
from data_plane.outbox import Outbox
from data_plane.replies import Replies
from data_plane.reports import WorkerIdentity, worker_status
from shared.policy import RequestState, RequestView, Snapshot
from shared.protocol import StateSnapshot, decode
from shared.protocol.convert import rows_from_table


def test_a_snapshot_that_cannot_travel_is_skipped_not_fatal() -> None:
    kv = KVCacheManager.hbm_only(8, 4)
    planner: Any = SimpleNamespace(
        source="local", delta_base=lambda iteration: None, min_residency_s=1.75
    )
    identity = WorkerIdentity("w0", "e1", 64)
    outbox = Outbox(cast(Any, None), Replies(), planner, kv, identity, snapshot_deltas=False)
    view = RequestView("r", RequestState.WAITING, t_arr_s=float("nan"), num_tokens=3)
    bad = Snapshot(1.0, (view,), 4, 0, 4, 64, 8, iteration=3)
    snapshot_bytes = outbox.snapshot_bytes
    assert snapshot_bytes(StepResult([], bad), 0.01) is None  # logged, the worker goes on
    good = replace(bad, requests=(view._replace(t_arr_s=0.5),))
    data = snapshot_bytes(StepResult([], good), 0.01)
    assert data is not None
    msg = decode(data, StateSnapshot)
    assert rows_from_table(msg.requests)[0].t_arr_s == 0.5 and msg.iteration == 3
    assert msg.lvf_min_residency_s == 1.75  # the worker's residency, for the control plane


def test_waiting_tokens_count_what_is_not_computed_yet(stories_path: Path) -> None:
    """A request preempted by recompute waits with its output to compute again: counted."""
    loaded = load_model(str(stories_path))
    engine = build_engine(loaded, EngineConfig(block_size=4, num_hbm_blocks=30))
    prompts = [[1, 403, 407, 261, 378], [1, 432, 383], [1, 286, 261, 376, 298, 315]]
    for index, prompt in enumerate(prompts * 2):
        engine.add_request(f"r{index}", prompt, SamplingParams(max_tokens=48, temperature=0))
    preempted: list[Any] = []
    while engine.has_unfinished() and not preempted:
        engine.step()
        preempted = [r for r in engine.waiting if r.output_token_ids]
    assert preempted, "no request was preempted by recompute"
    identity = WorkerIdentity("w0", "e1", 64)
    status = worker_status(
        engine,
        identity,
        time.time(),
        model_name="m",
        mean_iteration_s=0.0,
        plan_source="local",
        policy="vllm",
        accepting=True,
    )
    assert status.num_waiting_tokens == sum(r.num_tokens for r in engine.waiting)
    assert status.num_waiting_tokens > sum(len(r.prompt_token_ids) for r in engine.waiting)


def test_status_carries_the_b_xfer_in_force_and_the_measured_link(stories_path: Path) -> None:
    """An operator with ``b_xfer: auto`` sees what it resolved to (and the link it measured)."""
    loaded = load_model(str(stories_path))
    config = EngineConfig(block_size=4, num_hbm_blocks=64, num_dram_blocks=64)
    engine = build_engine(loaded, replace(config, transfer_backend="cpu"))
    engine.kv.set_b_xfer_blocks(37)
    engine.add_request("r0", [1, 403, 407, 261, 378], SamplingParams(max_tokens=24, temperature=0))
    while engine.has_unfinished():
        engine.step()
    engine.kv.drain()  # the eager syncs of full blocks have landed and been timed
    status = worker_status(
        engine,
        WorkerIdentity("w0", "e1", 64),
        time.time(),
        model_name="m",
        mean_iteration_s=0.0,
        plan_source="local",
        policy="lvf",
        accepting=True,
    )
    assert status.b_xfer_blocks == 37
    assert status.link_bytes_per_s > 0  # full blocks were synced to DRAM: the link was timed
