"""The baselines reproduce their peers' documented choices (SUPERINFER.md §7) on small scripted
scenarios: ``vllm`` (V1 FCFS), ``vllm-priority``, ``swap`` (V0 swap mode) and ``edf``.

The V1 behaviour was checked against vllm/v1/core/sched/scheduler.py (``Scheduler.schedule``):
running requests first within the token budget; on a failed block allocation
``self.running.pop()`` (FCFS) or ``max(self.running, key=(priority, arrival_time))``
(priority) is preempted, freed and reset to recompute, repeatedly, until the request itself is
the victim; waiting requests are only considered when nothing was preempted, stop at
``max_num_running_reqs`` and at the first allocation that fails.
"""

from __future__ import annotations

from shared.policy import Knobs, Plan, RequestState, RequestView, Snapshot, make_plan
from shared.policy.types import ScheduledChunk

BS = 4
VLLM = Knobs(policy="vllm")
PRIORITY = Knobs(policy="vllm-priority")
SWAP = Knobs(policy="swap")
EDF = Knobs(policy="edf")


def decode(
    rid: str,
    *,
    blocks: int = 1,
    full: bool = False,
    seq: int = 0,
    priority: int = 0,
    resident: bool = True,
    dram: int = 0,
) -> RequestView:
    """A running decode holding ``blocks`` blocks; ``full``: its last block is full, so its
    next token needs a new block."""
    computed = blocks * BS if full else blocks * BS - 1
    return RequestView(
        rid,
        RequestState.RUNNING,
        t_arr_s=float(seq),
        num_tokens=computed + 1,
        num_computed_tokens=computed,
        num_blocks_hbm=blocks,
        num_blocks_dram=dram,
        t_run_s=float(seq),
        arrival_seq=seq,
        priority=priority,
        resident=resident,
    )


def prefill(rid: str, *, computed: int, pending: int, seq: int = 0) -> RequestView:
    """A running request in the middle of a chunked prefill."""
    return RequestView(
        rid,
        RequestState.RUNNING,
        t_arr_s=float(seq),
        num_tokens=computed + pending,
        num_computed_tokens=computed,
        num_blocks_hbm=-(-computed // BS),
        t_run_s=float(seq),
        arrival_seq=seq,
    )


def waiting(
    rid: str, *, tokens: int = BS, seq: int = 0, priority: int = 0, slo_ttft: float | None = None
) -> RequestView:
    return RequestView(
        rid,
        RequestState.WAITING,
        t_arr_s=float(seq),
        num_tokens=tokens,
        arrival_seq=seq,
        priority=priority,
        slo_ttft_s=slo_ttft,
    )


def rotary(rid: str, *, blocks: int = 1, seq: int = 0) -> RequestView:
    return RequestView(
        rid,
        RequestState.ROTARY,
        t_arr_s=float(seq),
        num_tokens=blocks * BS,
        num_computed_tokens=blocks * BS - 1,
        num_blocks_dram=blocks,
        t_last_s=float(seq) + 1.0,
        arrival_seq=seq,
    )


def snap(
    *views: RequestView, free: int, budget: int = 512, seqs: int = 16, dram: int = 100
) -> Snapshot:
    return Snapshot(
        t_now_s=100.0,
        requests=tuple(views),
        num_free_hbm_blocks=free,
        num_free_dram_blocks=dram,
        block_size=BS,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
    )


def batch(plan: Plan) -> list[tuple[str, int]]:
    return [(chunk.request_id, chunk.num_tokens) for chunk in plan.schedule]


# ---- vllm (V1, FCFS) -------------------------------------------------------------------------


def test_decodes_first_then_prefill_chunks_then_new_requests() -> None:
    snapshot = snap(
        prefill("p", computed=8, pending=20, seq=0),
        decode("d1", seq=1),
        decode("d2", seq=2),
        waiting("w", tokens=30, seq=3),
        free=100,
        budget=40,
    )
    plan = make_plan(snapshot, VLLM)
    assert batch(plan) == [("d1", 1), ("d2", 1), ("p", 20), ("w", 18)]  # w: a chunk, too
    assert plan.admit_ids == ["w"] and not plan.fcfs_fallback


def test_chunked_prefill_stops_at_the_token_budget() -> None:
    snapshot = snap(
        decode("d", seq=0), prefill("p", computed=4, pending=100, seq=1), waiting("w"), free=100
    )
    plan = make_plan(snapshot, VLLM)
    assert batch(plan) == [("d", 1), ("p", 100), ("w", 4)]
    plan = make_plan(snap(*snapshot.requests, free=100, budget=64), VLLM)
    assert batch(plan) == [("d", 1), ("p", 63)]  # budget spent: nobody admitted
    assert plan.admit_ids == []


def test_new_request_gets_only_the_blocks_its_chunk_needs() -> None:
    snapshot = snap(waiting("w", tokens=40), free=3, budget=12)  # 12 tokens: 3 blocks
    assert batch(make_plan(snapshot, VLLM)) == [("w", 12)]


def test_block_shortage_preempts_the_last_running_request_repeatedly_even_itself() -> None:
    # a, b, c each need a new block for their next token; nothing is free
    views = [decode(r, full=True, seq=i) for i, r in enumerate("abc")]
    snapshot = snap(*views, waiting("w"), free=0)
    plan = make_plan(snapshot, VLLM)
    # a: c is popped (1 block back), a takes it; b: the last running request is b itself
    assert plan.preempt_ids == ["c", "b"]
    assert batch(plan) == [("a", 1)]
    assert plan.admit_ids == []  # a step that preempted admits nobody, though w would fit


def test_victim_is_last_in_running_order_even_if_already_scheduled() -> None:
    # running order [p, d]; decodes go first, so d is scheduled before p asks for blocks;
    # V1 walks [p, d] in order and pops d: the same outcome, d preempted, p scheduled
    p = prefill("p", computed=4, pending=8, seq=0)  # needs 2 new blocks
    d = decode("d", blocks=2, seq=1)
    plan = make_plan(snap(p, d, free=0), VLLM)
    assert plan.preempt_ids == ["d"]
    assert batch(plan) == [("p", 8)]


def test_preempted_requests_are_never_scheduled() -> None:
    views = [decode("a", full=True, seq=0), decode("b", seq=1), decode("c", full=True, seq=2)]
    plan = make_plan(snap(*views, free=0), VLLM)
    # a pops c (1 block); b needs nothing; c is gone
    assert plan.preempt_ids == ["c"] and batch(plan) == [("a", 1), ("b", 1)]
    views = [decode("a", full=True, blocks=1, seq=0), decode("b", blocks=1, seq=1)]
    plan = make_plan(snap(*views, free=0), VLLM)
    # a pops b, the last running request, although b itself needed no new block
    assert plan.preempt_ids == ["b"] and batch(plan) == [("a", 1)]


def test_fcfs_head_of_line_blocking() -> None:
    snapshot = snap(
        waiting("big", tokens=40, seq=0), waiting("small", tokens=4, seq=1), free=5, budget=64
    )
    plan = make_plan(snapshot, VLLM)
    assert plan.admit_ids == [] and plan.schedule == []  # big needs 10 blocks, blocks small
    plan = make_plan(snap(*snapshot.requests, free=10, budget=64), VLLM)
    assert plan.admit_ids == ["big"]  # no block left for small
    plan = make_plan(snap(*snapshot.requests, free=11, budget=64), VLLM)
    assert plan.admit_ids == ["big", "small"]


def test_waiting_queue_order_is_kept() -> None:
    # the engine puts a preempted request at the front of waiting; FCFS keeps that order
    preempted = waiting("old", tokens=8, seq=5)
    snapshot = snap(preempted, waiting("new", tokens=8, seq=1), free=2, budget=64)
    assert make_plan(snapshot, VLLM).admit_ids == ["old"]


def test_max_num_seqs_caps_admission() -> None:
    views = [decode("a", seq=0), decode("b", seq=1)]
    views += [waiting(f"w{i}", seq=2 + i) for i in range(3)]
    plan = make_plan(snap(*views, free=100, seqs=3), VLLM)
    assert plan.admit_ids == ["w0"]
    assert len(plan.schedule) == 3


def test_non_resident_running_request_sits_out() -> None:
    plan = make_plan(snap(decode("h2d", resident=False), decode("d", seq=1), free=4), VLLM)
    assert batch(plan) == [("d", 1)]


def test_rotary_requests_left_over_are_resumed_before_admission() -> None:
    snapshot = snap(rotary("r", blocks=2, seq=3), waiting("w", seq=0), free=3)
    plan = make_plan(snapshot, VLLM)
    assert plan.resume_ids == ["r"] and plan.admit_ids == ["w"]
    assert batch(plan) == [("w", 4)]  # r runs once its KV is back in HBM
    plan = make_plan(snap(*snapshot.requests, free=2), VLLM)
    assert plan.resume_ids == ["r"] and plan.admit_ids == []  # r took the last 2 blocks


# ---- vllm-priority -----------------------------------------------------------------------------


def test_priority_orders_waiting_by_priority_then_arrival() -> None:
    views = [
        waiting("late-urgent", seq=3, priority=0),
        waiting("early-lax", seq=0, priority=5),
        waiting("early-urgent", seq=1, priority=0),
    ]
    plan = make_plan(snap(*views, free=2), PRIORITY)
    assert plan.admit_ids == ["early-urgent", "late-urgent"]
    assert make_plan(snap(*views, free=2), VLLM).admit_ids == ["late-urgent", "early-lax"]


def test_priority_evicts_the_worst_priority() -> None:
    views = [
        decode("a", full=True, seq=0, priority=1),
        decode("lax", seq=1, priority=9),
        decode("b", seq=2, priority=0),
    ]
    plan = make_plan(snap(*views, free=0), PRIORITY)
    assert plan.preempt_ids == ["lax"]  # not the last running request, b
    assert batch(plan) == [("a", 1), ("b", 1)]
    ties = [decode("x", full=True, seq=0, priority=1), decode("y", seq=1, priority=1)]
    ties.append(decode("z", seq=2, priority=1))
    assert make_plan(snap(*ties, free=0), PRIORITY).preempt_ids == ["z"]  # latest arrival


# ---- swap (V0 --preemption-mode swap) ----------------------------------------------------------


def test_swap_rotates_victims_out_when_dram_has_room() -> None:
    views = [decode(r, full=True, seq=i) for i, r in enumerate("abc")]
    plan = make_plan(snap(*views, waiting("w"), free=0, dram=10), SWAP)
    assert plan.rotate_out_ids == ["c", "b"] and plan.preempt_ids == []
    # rotated-out blocks are free only after the D2H copy: a waits a step for its block
    assert plan.schedule == [] and plan.admit_ids == []


def test_swap_recomputes_when_dram_is_full() -> None:
    views = [decode(r, full=True, seq=i) for i, r in enumerate("abc")]
    plan = make_plan(snap(*views, free=0, dram=0), SWAP)
    assert plan.preempt_ids == ["c", "b"] and plan.rotate_out_ids == []
    assert batch(plan) == [("a", 1)]  # recompute frees at once
    synced = [decode("a", full=True, seq=0), decode("b", full=True, seq=1, dram=1)]
    plan = make_plan(snap(*synced, free=0, dram=0), SWAP)
    assert plan.rotate_out_ids == ["b"]  # all of b's blocks are in DRAM already


def test_swap_recomputes_a_victim_still_swapping_in() -> None:
    """V0 never preempts mid-swap-in: a victim whose KV is still being copied in (just
    resumed: last in running order) is recomputed, not parked."""
    views = [decode("a", full=True, seq=0), decode("b", seq=1, dram=1, resident=False)]
    plan = make_plan(snap(*views, free=0, dram=10), SWAP)
    assert plan.preempt_ids == ["b"] and plan.rotate_out_ids == []


def test_swap_resumes_swapped_first_and_admits_nobody_meanwhile() -> None:
    views = [waiting("w", seq=0), rotary("r2", seq=2), rotary("r1", seq=1), decode("d", seq=3)]
    plan = make_plan(snap(*views, free=10), SWAP)
    assert plan.resume_ids == ["r1", "r2"] and plan.admit_ids == []  # w arrived first
    assert batch(plan) == [("d", 1)]
    plan = make_plan(snap(*views, free=1), SWAP)
    assert plan.resume_ids == ["r1"] and plan.admit_ids == []
    plan = make_plan(snap(views[0], views[3], free=10), SWAP)  # nobody swapped out
    assert plan.admit_ids == ["w"]


def test_swap_passes_over_a_request_whose_rotate_out_is_in_flight() -> None:
    evicting = RequestView(
        "r0",
        RequestState.ROTARY,
        t_arr_s=0.0,
        num_tokens=BS,
        num_computed_tokens=BS - 1,
        num_blocks_hbm=1,
        t_last_s=1.0,
    )
    plan = make_plan(snap(evicting, rotary("r1", seq=1), waiting("w", seq=2), free=5), SWAP)
    assert plan.resume_ids == ["r1"] and plan.admit_ids == []


def test_swap_does_not_resume_in_a_step_that_preempted() -> None:
    views = [decode("a", full=True, seq=0), decode("b", seq=1), rotary("r", seq=2)]
    plan = make_plan(snap(*views, free=0), SWAP)
    assert plan.rotate_out_ids == ["b"] and plan.resume_ids == []


# ---- edf (Gateway API Inference Extension ordering) ------------------------------------------


def test_edf_orders_waiting_by_deadline() -> None:
    views = [
        waiting("lax", seq=0, slo_ttft=10.0),  # deadline 10
        waiting("tight", seq=1, slo_ttft=2.0),  # deadline 3
        waiting("default", seq=2),  # deadline 2 + S_F (5) = 7
    ]
    plan = make_plan(snap(*views, free=2), EDF)
    assert plan.admit_ids == ["tight", "default"]
    plan = make_plan(snap(*views, free=2), Knobs(policy="edf", slo_ttft_s=20.0))
    assert plan.admit_ids == ["tight", "lax"]  # default deadline 22 now


def test_edf_evicts_the_latest_deadline() -> None:
    views = [
        decode("a", full=True, seq=0),
        RequestView(
            "far",
            RequestState.RUNNING,
            t_arr_s=1.0,
            num_tokens=4,
            num_computed_tokens=3,
            num_blocks_hbm=1,
            arrival_seq=1,
            slo_ttft_s=60.0,
        ),
        decode("b", seq=2),
    ]
    plan = make_plan(snap(*views, free=0, dram=0), EDF)
    assert plan.preempt_ids == ["far"] and plan.schedule == [
        ScheduledChunk("a", 1),
        ScheduledChunk("b", 1),
    ]
