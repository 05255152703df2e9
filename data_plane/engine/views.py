"""What the engine shows its policy: each request's view, and the iteration's snapshot.

:class:`PolicyViews` owns the waiting queue and the rotary set (:class:`RequestQueue`, which
keep their requests' views and columns) and the prefix watch that keeps the waiting views
fresh; the engine moves requests in and out of the queues, this builds what the policy reads
from them, the running list and the KV manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from data_plane.engine.prefix_watch import PrefixWatch
from data_plane.engine.queues import RequestQueue
from data_plane.engine.request import Request
from shared.policy import ColumnarSnapshot, RequestColumns, RequestState, RequestView, Snapshot
from shared.policy.columns import column_arrays_from_views, concat_column_arrays
from shared.policy.types import compile_view_builder

if TYPE_CHECKING:  # the KV layer holds torch tensors; the views need no torch
    from data_plane.kv.tiered import KVCacheManager

# Where each field of the policy's view comes from: an expression over the request ``r`` and
# the block counts its caller gives (one per REQUEST_FIELDS name, checked when compiled).
_VIEW_SOURCES = {
    "request_id": "r.request_id",
    "state": "r.state",
    "t_arr_s": "r.t_arr_s",
    "num_tokens": "len(r.prompt_token_ids) + len(r.output_token_ids)",  # r.num_tokens, inlined
    "num_computed_tokens": "num_computed",
    "num_blocks_hbm": "num_hbm",
    "num_blocks_dram": "num_dram",
    "t_run_s": "r.t_run_s",
    "t_last_s": "r.t_last_s",
    "priority": "r.priority",
    "arrival_seq": "r.arrival_seq",
    "slo_ttft_s": "r.slo_ttft_s",
    "slo_tbt_s": "r.slo_tbt_s",
    "resident": "r.resident",
    "tenant": "r.tenant",
    "t_first_s": "r.t_first_token_s",
    "num_output_tokens": "len(r.output_token_ids)",
}
_build_view = compile_view_builder(_VIEW_SOURCES, ("r", "num_computed", "num_hbm", "num_dram"))


class PolicyViews:
    """The waiting and rotary queues with their views, and the snapshots built from them."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._prefix_watch = PrefixWatch()  # waiting requests' views x the cache's changes
        self.waiting = RequestQueue(self._waiting_view)
        self.rotary = RequestQueue(self.view, RequestState.ROTARY)

    def leave_waiting(self, request: Request) -> None:
        self.waiting.remove(request)
        self._prefix_watch.forget(request.request_id)

    def refresh_waiting(self) -> None:
        """Rebuild the views of the waiting requests whose prefix hits the cache's changes
        since the last iteration may have changed (:mod:`data_plane.engine.prefix_watch`)."""
        changed = self.kv.drain_prefix_changes() if self.kv.prefix_caching else None
        if changed and self.waiting:
            affected = self._prefix_watch.affected(changed)
            if affected:
                self.waiting.refresh(affected)

    def view(
        self,
        r: Request,
        num_computed: int | None = None,
        num_hbm: int = 0,
        num_dram: int = 0,
    ) -> RequestView:
        """The policy's view of ``r``: one per running and rotary request per iteration.
        ``num_computed``: given with the block counts for a waiting request, else its own and
        its block table's."""
        if num_computed is None:
            num_hbm, num_dram = self.kv.block_counts(r.request_id)
            num_computed = r.num_computed_tokens
        return _build_view(r, num_computed, num_hbm, num_dram)

    def _waiting_view(self, r: Request) -> RequestView:
        """A waiting request's view: what its cached prefix will not prefill counts as
        computed, its blocks in use by others and in DRAM as its; the keys that answer
        depends on are watched (the hits and the first miss). One that reads no cache (its
        keys were extended as it computed, for others to share its blocks) is seen without."""
        if not r.block_keys or not r.reads_prefix_cache:
            return self.view(r)
        hits = self.kv.prefix_hits(r.all_token_ids, r.block_keys)
        self._prefix_watch.watch(r.request_id, r.block_keys[: hits.num_blocks + 1])
        num_computed = hits.num_blocks * self.kv.block_size
        return self.view(r, num_computed, hits.num_hbm_in_use, hits.num_dram)

    def planner_input(
        self,
        now: float,
        running: Sequence[Request],
        counts: dict[str, Any],
        columnar: bool,
        keep_columns: bool,
    ) -> tuple[Snapshot | ColumnarSnapshot, RequestColumns | None]:
        """The snapshot the planner gets (views, or columns when ``columnar``) and, with
        ``keep_columns``, its requests as columns (the worker publishes them), built from the
        queues' cached columns, not from the views."""
        if columnar:
            snapshot = self.columnar_snapshot(now, running, counts)
            return snapshot, snapshot.requests if keep_columns else None
        views = self.snapshot(now, running, counts)
        return views, self.columns(views.requests[: len(running)]) if keep_columns else None

    def snapshot(self, now: float, running: Sequence[Request], counts: dict[str, Any]) -> Snapshot:
        """Running, then waiting, then rotary requests."""
        view = self.view
        views = [view(r) for r in running]
        views += self.waiting.views()
        views += [view(r) for r in self.rotary]
        return Snapshot(
            t_now_s=now,
            requests=tuple(views),
            partition=(len(running), len(self.waiting)),
            **counts,
        )

    def columnar_snapshot(
        self, now: float, running: Sequence[Request], counts: dict[str, Any]
    ) -> ColumnarSnapshot:
        """:meth:`snapshot` as columns (the waiting requests' come ready-made)."""
        view = self.view
        requests = self.columns([view(r) for r in running])
        return ColumnarSnapshot(t_now_s=now, requests=requests, **counts)

    def columns(self, running_views: Sequence[RequestView]) -> RequestColumns:
        """Running (from their views), waiting and rotary requests as columns, copied once
        out of the queues' buffers."""
        parts: list[dict[str, Any]] = []
        if running_views:
            parts.append(column_arrays_from_views(running_views))
        if self.waiting:
            parts.append(self.waiting.column_arrays())
        if self.rotary:
            rotary_columns = self.kv.rotary_columns(self.rotary.request_ids())
            parts.append(self.rotary.column_arrays(rotary_columns))
        return concat_column_arrays(parts)
