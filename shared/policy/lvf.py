"""Largest-VLT-First (SUPERINFER.md §4), once per engine iteration, as a pure function.

L = running + waiting + rotary ranked by VLT, descending (ties: arrival time, then arrival
order). Waiting and rotary requests have VLT >= 0 and running ones VLT <= 0, so the head scan
(step 3) only ever takes waiting/rotary requests and the tail scan (step 4) only running ones:
each scan ranks only its own part of L, which keeps the planner cheap at thousands of requests.

This version walks :class:`RequestView` objects (the worker's in-process snapshot; fastest for
the small snapshots of most iterations). ``shared/policy/lvf_columnar.py`` makes the same plans
over numpy columns (the control plane's snapshots, and the simulator's engine, whose queues
reach thousands); a change to one must be made to the other (tests/shared/
test_policy_columnar.py compares them on random snapshots).
"""

from __future__ import annotations

from collections.abc import Iterator

from shared.policy.common import arrival_key, pack_schedule
from shared.policy.types import Knobs, Plan, RequestState, RequestView, Snapshot
from shared.policy.vlt import vlt_scores

_RUNNING = RequestState.RUNNING
_ROTARY = RequestState.ROTARY
_WAITING = RequestState.WAITING


def lvf(snapshot: Snapshot, knobs: Knobs) -> Plan:
    """Choose from the head of L within B_HBM + B_xfer and ``max_num_seqs``; rotate out from
    the tail while VLT < 0 and B_swap > 0; then pack the batch.

    B_HBM is the free HBM left after the running requests' next-chunk growth. Without room in
    DRAM a rotate-out victim is preempted by recompute instead. A chosen request acts only
    when it can this iteration (see :func:`_join_and_pack`); otherwise it keeps its state and
    its VLT and is chosen again next iteration, once the rotated-out blocks are free.
    """
    running, candidates, scores, growth, tokens = _classify(snapshot, knobs)
    b_hbm = snapshot.num_free_hbm_blocks - growth
    if _no_contention(candidates, tokens, b_hbm, snapshot.block_size):
        return _fcfs(snapshot, running, candidates, b_hbm)
    plan = Plan()
    b_xfer = snapshot.b_xfer_blocks
    seats = snapshot.max_num_seqs - len(running)
    chosen, b_left = _head_scan(candidates, scores, b_hbm + b_xfer, seats, snapshot.block_size)
    b_swap = b_xfer - b_left
    if b_swap > 0:
        _rotate_out_tail(running, snapshot, knobs, b_swap, -b_hbm, plan)
    _join_and_pack(snapshot, running, chosen, plan, b_hbm)
    return plan


def _classify(
    snapshot: Snapshot, knobs: Knobs
) -> tuple[list[RequestView], list[RequestView], list[float], int, int]:
    """One pass over the snapshot: (running, waiting + rotary, their VLTs, the running
    requests' growth in blocks, the waiting and rotary requests' tokens).

    The VLTs are :func:`~shared.policy.vlt.vlt`'s formula inlined (bit for bit; a property
    test holds them together): this loop is the planner's hot path.
    """
    bs, max_tokens, t_now = snapshot.block_size, snapshot.max_num_batched_tokens, snapshot.t_now_s
    alpha, beta_b, beta_f = knobs.alpha, knobs.beta_b, knobs.beta_f
    tol_b, tol_f = beta_b * knobs.slo_tbt_s, beta_f * knobs.slo_ttft_s
    running: list[RequestView] = []
    candidates: list[RequestView] = []
    scores: list[float] = []
    add_running, add_candidate, add_score = running.append, candidates.append, scores.append
    is_running, is_waiting = _RUNNING, _WAITING  # locals: this loop runs per request
    growth = tokens = 0
    for view in snapshot.requests:
        state = view.state
        if state is is_running:
            add_running(view)
            computed = view.num_computed_tokens
            num_new = view.num_tokens - computed
            if num_new > max_tokens:
                num_new = max_tokens
            need = -(-(computed + num_new) // bs) - view.num_blocks_hbm
            if need > 0:
                growth += need
            continue
        add_candidate(view)
        tokens += view.num_tokens
        if state is is_waiting:
            slo = view.slo_ttft_s
            lag = t_now - view.t_arr_s - (tol_f if slo is None else beta_f * slo)
            add_score(lag if lag > 0.0 else 0.0)
        else:
            slo, t_last = view.slo_tbt_s, view.t_last_s
            lag = (
                t_now
                - (view.t_arr_s if t_last is None else t_last)
                - (tol_b if slo is None else beta_b * slo)
            )
            add_score(alpha * (lag if lag > 0.0 else 0.0))
    return running, candidates, scores, growth, tokens


def _no_contention(candidates: list[RequestView], tokens: int, b_hbm: int, bs: int) -> bool:
    """Step 1: B_HBM >= sum of blk(r) over waiting + rotary, from their token sum when that
    decides it (sum(blk) lies in [tokens / bs, (tokens + n * (bs - 1)) / bs])."""
    if b_hbm * bs < tokens:
        return False
    if b_hbm * bs >= tokens + len(candidates) * (bs - 1):
        return True
    return b_hbm >= sum(-(-v.num_tokens // bs) for v in candidates)


def _rank(views: list[RequestView], scores: list[float], head: bool) -> Iterator[int]:
    """Indices of ``views`` in L's order (``head``: VLT descending, equal VLTs first come
    first) or in reversed L's order (VLT ascending, equal VLTs last come first).

    Lazy: a scan usually stops after a few requests, so runs of equal VLT (waiting requests
    clamped to 0, requests that decoded or were admitted in the same batch) are put in arrival
    order only when the scan reaches them.
    """
    order = sorted(range(len(views)), key=scores.__getitem__, reverse=head)
    n, start = len(order), 0
    while start < n:
        score = scores[order[start]]
        end = start + 1
        while end < n and scores[order[end]] == score:
            end += 1
        if end - start == 1:
            yield order[start]
        else:
            run = order[start:end]
            run.sort(key=lambda i: arrival_key(views[i]), reverse=not head)
            yield from run
        start = end


def _head_scan(
    candidates: list[RequestView], scores: list[float], b_left: int, seats: int, block_size: int
) -> tuple[list[RequestView], int]:
    """Step 3: from the head of L take every request (waiting/rotary: VLT >= 0) whose blk(r)
    fits in B_left, while a seat is free; one that does not fit is skipped and the scan goes
    on. A rotary request that still holds HBM blocks (its rotate-out copy is in flight) cannot
    come back yet and is skipped too. Returns (chosen, B_left)."""
    chosen: list[RequestView] = []
    if seats <= 0 or b_left <= 0:
        return chosen, b_left
    for i in _rank(candidates, scores, head=True):
        view = candidates[i]
        blk = -(-view.num_tokens // block_size)
        if blk <= b_left and not view.num_blocks_hbm:  # else: a rotate-out still in flight
            chosen.append(view)
            b_left -= blk
            seats -= 1
            if seats <= 0 or b_left <= 0:
                break  # nobody else can join (every waiting/rotary request needs >= 1 block)
    return chosen, b_left


def _rotate_out_tail(
    running: list[RequestView],
    snapshot: Snapshot,
    knobs: Knobs,
    b_swap: int,
    shortage: int,
    plan: Plan,
) -> None:
    """Step 4: from the tail of L (longest running first) while VLT < 0 and B_swap > 0,
    rotate out. A victim DRAM has no room for (its unsynced blocks) stays running:
    proactive rotation never turns into recompute (under sustained overload with DRAM full,
    throwing away a long prompt's KV to admit another one spends the GPU on prefills that
    are thrown away in turn). If such a victim was needed because HBM is short for the
    running requests' own growth, the shortage the rotations leave is covered as vLLM
    covers it: recompute preemption of the newest running requests (the least work lost),
    see :func:`_recompute_newest`.

    Passed over: requests that hold no HBM block (nothing to free), whose KV is still arriving
    (H2D in flight), and, unless HBM is short for the running requests' own growth
    (``shortage`` = -B_HBM blocks not yet freed), requests that have not generated a token
    since they (re)entered running. Without that guard a resumed request whose H2D copy takes
    an iteration or two is the longest "running" one by the time it could run, is rotated out
    unserved, lags again, is resumed again: a livelock in which nothing is ever scheduled.
    """
    scores = vlt_scores(running, snapshot.t_now_s, knobs)
    free_dram = snapshot.num_free_dram_blocks
    uncovered, no_room = shortage, False
    for i in _rank(running, scores, head=False):
        if scores[i] >= 0:
            break
        view = running[i]
        held = view.num_blocks_hbm
        settled = _served(view) and scores[i] < -knobs.min_residency_s
        if held <= 0 or not view.resident or (shortage <= 0 and not settled):
            continue
        dram_needed = held - view.num_blocks_dram
        if dram_needed <= free_dram:
            plan.rotate_out_ids.append(view.request_id)
            free_dram -= max(0, dram_needed)
            uncovered -= held
        elif shortage > 0:
            no_room = True
        b_swap -= held
        shortage -= held
        if b_swap <= 0:
            break
    if no_room:
        _recompute_newest(running, plan, uncovered)


def _recompute_newest(running: list[RequestView], plan: Plan, shortage: int) -> None:
    """Preempt by recompute from the end of the running list (the newest, as vLLM V1's
    ``running.pop()``) until ``shortage`` blocks are freed; passed over: requests rotating
    out, holding no HBM block, or whose KV is still arriving."""
    leaving = set(plan.rotate_out_ids)
    for view in reversed(running):
        if shortage <= 0:
            return
        if view.request_id in leaving or not view.num_blocks_hbm or not view.resident:
            continue
        plan.preempt_ids.append(view.request_id)
        shortage -= view.num_blocks_hbm


def _served(view: RequestView) -> bool:
    """Has ``view`` generated a token since it (re)entered running?"""
    t_last, t_run = view.t_last_s, view.t_run_s
    return t_last is not None and (t_run is None or t_last >= t_run)


def _join_and_pack(
    snapshot: Snapshot, running: list[RequestView], chosen: list[RequestView], plan: Plan, room: int
) -> None:
    """Act on the chosen requests, in rank order, then pack the batch.

    ``room`` is B_HBM: the free HBM after the running requests' growth. A chosen rotary
    request is resumed now if its blocks fit in what is left of it (the H2D copy needs free
    HBM; rotated-out blocks only come free after their D2H copy) and its own rotate-out copy
    is done (it holds no HBM block any more); otherwise it stays rotary and is chosen again
    next iteration. One that waits for room holds it: no request ranked below it acts this
    iteration (else smaller waiting requests take the room first, iteration after
    iteration, and a long rotary request parked in a full DRAM never comes back). A chosen
    waiting request starts only if its whole KV, blk(r), fits what is left of the room, as
    §4 counts it (a prefill started in the last free blocks is preempted by the running
    requests' growth a step later, and restarts, in a loop: at 50 req/s on ShareGPT that was
    most of LVF's 24,000 preemptions); one that does not fit keeps waiting and the scan goes
    on.

    Recompute victims (HBM short for the running requests' growth, DRAM full) free their
    blocks for that growth: as in vLLM, nobody joins in a step that preempted by recompute
    (else a newcomer takes the blocks and the next step preempts again, a long request's KV
    thrown away each time).

    The batch (the remaining running requests, then the chosen waiting ones) may use the free
    HBM plus the preempted requests' blocks (freed at once) less the resumes'. A chosen
    waiting request is admitted only if it gets a chunk in it (running means "KV in HBM,
    scheduled"); otherwise it keeps waiting, and its VLT, for the next iteration.
    """
    bs = snapshot.block_size
    free = snapshot.num_free_hbm_blocks
    leaving = set(plan.rotate_out_ids)
    if plan.preempt_ids:
        preempted = set(plan.preempt_ids)
        leaving |= preempted
        freed = sum(v.num_blocks_hbm for v in running if v.request_id in preempted)
        free, room = free + freed, room + freed
        chosen = []  # as in vLLM, a step that preempted by recompute lets nobody in
    joining: list[RequestView] = []
    for view in chosen:
        blk = -(-view.num_tokens // bs)
        if view.state is _ROTARY:
            if view.num_blocks_hbm:  # its rotate-out is still in flight: next time
                continue
            if blk > room:  # it waits for room; nobody ranked below takes that room
                break
            plan.resume_ids.append(view.request_id)
            free, room = free - blk, room - blk
        elif blk <= room:  # its whole KV fits the room left: it may start
            joining.append(view)
            room -= blk
    keep = [v for v in running if v.request_id not in leaving] if leaving else running
    plan.schedule = pack_schedule(keep + joining, snapshot, max(0, free))
    if joining:
        scheduled = {chunk.request_id for chunk in plan.schedule}
        plan.admit_ids = [v.request_id for v in joining if v.request_id in scheduled]


def _fcfs(
    snapshot: Snapshot, running: list[RequestView], candidates: list[RequestView], b_hbm: int
) -> Plan:
    """Enough HBM for every waiting and rotary request: no rotation, FCFS (arrival order)
    resumption and admission up to ``max_num_seqs``."""
    plan = Plan(fcfs_fallback=True)
    seats = max(0, snapshot.max_num_seqs - len(running))
    chosen = sorted(candidates, key=arrival_key)[:seats]
    _join_and_pack(snapshot, running, chosen, plan, b_hbm)
    return plan
