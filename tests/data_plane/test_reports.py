"""The worker's wire snapshot (data_plane/reports.py through Worker): a value that cannot
travel is logged and the snapshot skipped; the worker goes on."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from types import SimpleNamespace

from data_plane.engine.engine import StepResult
from data_plane.kv.tiered import KVCacheManager
from data_plane.service import Worker
from shared.policy import RequestState, RequestView, Snapshot
from shared.protocol import StateSnapshot, decode
from shared.protocol.convert import rows_from_table


def test_a_snapshot_that_cannot_travel_is_skipped_not_fatal() -> None:
    kv = KVCacheManager.hbm_only(8, 4)
    worker = SimpleNamespace(
        engine=SimpleNamespace(kv=kv),
        settings=SimpleNamespace(worker_id="w0"),
        epoch="e1",
        block_bytes=64,
        planner=SimpleNamespace(source="local", delta_base=lambda iteration: None),
        deltas=None,
    )
    view = RequestView("r", RequestState.WAITING, t_arr_s=float("nan"), num_tokens=3)
    bad = Snapshot(1.0, (view,), 4, 0, 4, 64, 8, iteration=3)
    snapshot_bytes = partial(Worker._snapshot_bytes, worker)
    assert snapshot_bytes(StepResult([], bad), 0.01) is None  # logged, the worker goes on
    good = replace(bad, requests=(view._replace(t_arr_s=0.5),))
    data = snapshot_bytes(StepResult([], good), 0.01)
    assert data is not None
    msg = decode(data, StateSnapshot)
    assert rows_from_table(msg.requests)[0].t_arr_s == 0.5 and msg.iteration == 3
