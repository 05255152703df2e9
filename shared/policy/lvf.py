"""Largest-VLT-First (SUPERINFER.md §4, Algorithm 1), once per engine iteration: one pure
function over the snapshot's requests as numpy columns (the only LVF implementation: the
worker, the control plane and the simulator all plan with it).

Algorithm 1, as the code runs it (``knobs`` at their §4 values, see :class:`Knobs`):

1. Contention check: B_HBM = free HBM blocks less the running requests' next-step growth; if
   B_HBM >= sum of blk(r) over waiting and rotary requests (and, ours: the free seats cover
   those that can start), fall back to FCFS.
2. L = running + waiting + rotary by VLT, descending (ties: arrival time, arrival order).
   B_left = B_HBM + B_xfer.
3. Head scan: take each request with VLT >= 0 whose blk(r) <= B_left, B_left -= blk(r).
4. Tail scan: B_swap = B_xfer - B_left; from the tail while VLT < 0 and B_swap > 0, rotate out,
   B_swap -= the blocks the victim frees (what it holds plus the growth it no longer needs).
5. The chosen requests join with the blocks the victims free in this same iteration (DuplexKV
   drops a victim's synced HBM blocks at once); a chosen waiting request starts only if its
   whole blk(r) fits the room left, a chosen rotary one resumes if its blocks do.

Seats (``max_num_seqs``) are a budget like blocks: the head scan may choose beyond the free
seats when the tail can free them, and the tail then rotates out at least one victim per
seat it owes. Mechanism rules that §4 leaves open (both documented in docs/scheduling.md):
a victim DRAM has no room for stays running (recompute only covers a real HBM shortage, the
newest first, as vLLM V1), and a step that preempted by recompute admits nobody (vLLM's rule).

Requests' ``priority`` (vLLM's) ranks them within each tier of the head scan and orders the
tail's victims, worst band first (``shared/policy/bands.py``); with one priority it changes
nothing. Extensions, each a knob (``Knobs``; defaults chosen from measurements,
docs/benchmarks.md):
``rotate_only_for_lag`` (head requests with VLT == 0 join only within free HBM: rotation
repays lag, it never makes room for a request that is not behind its SLO),
``min_residency_s`` (the tail passes over requests resident for less than this, unless
``residency_yields_to_tighter`` and a tighter SLO class lags), ``deadline_lag`` (waiting
requests and prefill chunks by deadline across SLO classes), ``demote_late_s`` (requests past
their TTFT after those that can still make it), ``lag_per_block`` (the head scan ranks
lagging requests by VLT / blk(r)),
``protect_unserved`` (the tail passes over requests that produced no token since they became
resident), ``hold_room_for_rotary`` (a chosen rotary request waiting for room blocks those
ranked below it). Under an HBM shortage for the running requests' own growth the tail guards
are lifted: the growth must be paid.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from shared.policy.bands import ScanGroups
from shared.policy.columns import (
    RUNNING_CODE,
    WAITING_CODE,
    ColumnarSnapshot,
    Ints,
    RequestColumns,
    columnar_from_snapshot,
    pick_ids,
)
from shared.policy.common import make_chunks
from shared.policy.fairness import over_served
from shared.policy.joining import (
    EMPTY,
    Transitions,
    candidate_blocks,
    join_and_pack,
    recompute_newest,
    running_growth,
    split_by_dram_room,
)
from shared.policy.packing import greedy_take
from shared.policy.types import Knobs, Plan, Snapshot
from shared.policy.vlt import late_waiting, looser_than_lagging, vlt_array

_SEGMENT = 256  # the scans rank this many of the most extreme VLTs first


def lvf(snapshot: Snapshot | ColumnarSnapshot, knobs: Knobs) -> Plan:
    """The LVF plan for ``snapshot`` (views are turned into columns first)."""
    if isinstance(snapshot, Snapshot):
        snapshot = columnar_from_snapshot(snapshot)
    moves = lvf_transitions(snapshot, knobs)
    ids = snapshot.requests.request_ids
    return Plan(
        schedule=make_chunks(pick_ids(ids, moves.batch), moves.tokens),
        admit_ids=pick_ids(ids, moves.admit),
        resume_ids=pick_ids(ids, moves.resume),
        rotate_out_ids=pick_ids(ids, moves.rotate_out),
        preempt_ids=pick_ids(ids, moves.preempt),
        fcfs_fallback=moves.fcfs_fallback,
    )


def lvf_transitions(
    snapshot: ColumnarSnapshot, knobs: Knobs, with_batch: bool = True
) -> Transitions:
    """:func:`lvf`'s plan as row indices (the control plane turns them into handles).
    ``with_batch`` False packs the batch only when it decides who is admitted."""
    columns = snapshot.requests
    bs = snapshot.block_size
    is_running = columns.states == RUNNING_CODE
    running, candidates = np.flatnonzero(is_running), np.flatnonzero(~is_running)
    growth = running_growth(snapshot, running)
    waiting = columns.states == WAITING_CODE  # blk(r) of every row as a waiting or rotary one
    blk = candidate_blocks(columns.num_tokens, columns.num_blocks_hbm, waiting, bs)
    b_hbm = snapshot.num_free_hbm_blocks - int(growth.sum())
    seats_free = snapshot.max_num_seqs - len(running)
    # a rotary request whose rotate-out copy is in flight cannot come back: no seat for it
    ready = candidates[(columns.num_blocks_hbm[candidates] == 0) | waiting[candidates]]
    if b_hbm >= int(blk[candidates].sum()) and len(ready) <= max(0, seats_free):
        # step 1: no contention for blocks or seats, FCFS
        arrival = np.lexsort((columns.arrival_seq[ready], columns.t_arr_s[ready]))
        chosen = ready[arrival[: max(0, seats_free)]]
        return join_and_pack(
            snapshot, running, growth, chosen, (EMPTY, EMPTY), True, knobs, with_batch
        )
    over = _over_served(snapshot, knobs)
    scores = _unforced_lag(vlt_array(columns, snapshot.t_now_s, knobs), over, is_running)
    groups = ScanGroups.of(columns, over)
    victims = _eligible_victims(columns, running, scores, knobs, over)
    b_xfer = snapshot.b_xfer_blocks
    late = late_waiting(columns, snapshot.t_now_s, knobs)
    seating = (seats_free, len(victims))
    ranks = _head_ranks(scores, blk) if knobs.lag_per_block else scores
    chosen, b_left = _head_scan(
        columns, candidates, ranks, blk, (b_hbm, b_xfer), seating, (groups, late), knobs
    )
    victims = groups.displaceable(columns, victims, chosen)
    b_swap = b_xfer - b_left
    seats_owed = len(chosen) - seats_free
    leaving = (EMPTY, EMPTY)
    if b_swap > 0 or seats_owed > 0:
        owed = (b_swap, seats_owed, -b_hbm)
        leaving = _tail_scan(snapshot, running, growth, scores, victims, owed, groups)
    return join_and_pack(snapshot, running, growth, chosen, leaving, False, knobs, with_batch)


def _unforced_lag(
    scores: np.ndarray, over: np.ndarray | None, is_running: np.ndarray
) -> np.ndarray:
    """Per-tenant fairness: an over-served tenant's waiting and rotary requests do not lag (VLT
    0): they join within free HBM, never rotating another tenant's request out for room, and
    its parked streams stay parked while it is over-served (VTC's rule: the tenant with the
    most recent service waits). Without it their lag brought the heavy tenant's rotated
    requests straight back, ahead of the light tenants' new ones (light tenants -20 pts of
    TTFT attainment against their run alone at 1.5x the knee, bench/fairness.py)."""
    if over is None:
        return scores
    return np.where(over & ~is_running & (scores > 0), 0.0, scores)


def _head_ranks(scores: np.ndarray, blk: Ints) -> np.ndarray:
    """``lag_per_block``: the head scan's ranking, VLT / blk(r) for lagging requests (lag
    repaid per block of HBM the request takes, and per block the link moves to bring a rotary
    one back), VLT itself otherwise; the sign, and with it who lags, is kept."""
    return np.where(scores > 0, scores / np.maximum(blk, 1), scores)


def _head_scan(
    columns: RequestColumns,
    candidates: Ints,
    scores: np.ndarray,
    blk: Ints,
    budgets: tuple[int, int],
    seating: tuple[int, int],
    marks: tuple[ScanGroups, np.ndarray | None],
    knobs: Knobs,
) -> tuple[Ints, int]:
    """Step 3: the waiting/rotary requests taken from the head of L (in L's order, by
    ``scores``: the VLTs, or :func:`_head_ranks` with ``lag_per_block``) and B_left.
    ``budgets`` is (B_HBM, B_xfer), ``seating`` (free seats, eligible
    victims). A rotary request whose rotate-out copy is still in flight (it holds HBM blocks)
    cannot come back yet and is passed over. With ``rotate_only_for_lag`` the requests with
    VLT == 0 are scanned after the lagging ones, within the HBM left without rotation
    (B_left - B_xfer) and the free seats. ``marks`` is (groups, late): each scan takes
    ``groups``' head groups in turn (priority bands, and per-tenant fairness's: the other
    tenants' requests before the over-served ones'); ``late`` rows (``demote_late_s``) are
    scanned last, within free HBM."""
    b_hbm, b_xfer = budgets
    seats_free, num_victims = seating
    groups, late = marks
    is_waiting = columns.states[candidates] == WAITING_CODE  # its HBM blocks: a cached prefix
    movable = candidates[(columns.num_blocks_hbm[candidates] == 0) | is_waiting]
    demoted = EMPTY
    if late is not None:
        movable, demoted = movable[~late[movable]], movable[late[movable]]
    if knobs.rotate_only_for_lag:
        lagging = scores[movable] > 0
        first, second = movable[lagging], movable[~lagging]
    else:
        first, second = movable, EMPTY
    seat_credit = num_victims if b_xfer > 0 else 0  # a seat freed costs a rotation
    chosen, b_left = _take_groups(
        columns, first, groups, scores, blk, b_hbm + b_xfer, seats_free + seat_credit
    )
    for rest in (second, demoted):  # within the HBM left without rotation
        seats, room = seats_free - len(chosen), b_left - b_xfer
        if len(rest) and seats > 0 and room > 0:
            fresh, room_left = _take_groups(columns, rest, groups, scores, blk, room, seats)
            chosen, b_left = np.concatenate((chosen, fresh)), b_left - (room - room_left)
    return chosen, b_left


def _over_served(snapshot: ColumnarSnapshot, knobs: Knobs) -> np.ndarray | None:
    """The rows of over-served tenants when per-tenant fairness is on and a tenant present is
    over-served; else None (LVF unchanged)."""
    if not knobs.tenant_fairness or not snapshot.tenant_service:
        return None
    over = over_served(snapshot.requests.tenants, snapshot.tenant_service)
    return over if over.any() else None


def _take_groups(
    columns: RequestColumns,
    indices: Ints,
    groups: ScanGroups,
    scores: np.ndarray,
    blk: Ints,
    b_left: int,
    seats: int,
) -> tuple[Ints, int]:
    """:func:`_take_in_l_order` over ``groups``' head groups of ``indices`` in turn (the best
    priority band first; within a band the fairly served tenants' rows first), each with
    what the ones before left."""
    parts = groups.head(columns, indices)
    chosen, b_left = _take_in_l_order(columns, parts[0], scores, blk, b_left, seats)
    for part in parts[1:]:
        more, b_left = _take_in_l_order(columns, part, scores, blk, b_left, seats - len(chosen))
        chosen = np.concatenate((chosen, more))
    return chosen, b_left


def _take_in_l_order(
    columns: RequestColumns, indices: Ints, scores: np.ndarray, blk: Ints, b_left: int, seats: int
) -> tuple[Ints, int]:
    """Scan ``indices`` in L's order; take each whose blk(r) fits in B_left while seats last
    (one that does not fit is skipped; the scan ends when B_left is used up)."""
    if seats <= 0 or b_left <= 0 or not len(indices):
        return EMPTY, b_left
    chosen: list[Ints] = []
    for segment in _segments_of_l(columns, indices, scores, True, _SEGMENT):
        taken, b_left = greedy_take(blk[segment], b_left, seats, stop_at_zero=True)
        chosen.append(segment[taken])
        seats -= len(taken)
        if seats <= 0 or b_left <= 0:
            break
    return np.concatenate(chosen) if len(chosen) > 1 else chosen[0], b_left


def _segments_of_l(
    columns: RequestColumns, indices: Ints, scores: np.ndarray, head: bool, size: int
) -> Iterator[Ints]:
    """``indices`` in L's order (``head``: VLT descending, then arrival time, arrival order,
    snapshot order) or in the tail scan's (VLT ascending, later arrival first, snapshot
    order), as consecutive segments: the (at most) ``size`` most extreme VLTs first, then,
    only if the scan gets that far, the rest. Equal VLTs never straddle the cut (it lies
    strictly between VLT values), so the segments joined are the full order."""
    if len(indices) > 2 * size:
        scan_keys = -scores[indices] if head else scores[indices]  # ascending = scan order
        cut = np.partition(scan_keys, size)[size]
        first = scan_keys < cut
        yield _in_scan_order(columns, indices[first], scores, head)
        indices = indices[~first]
    yield _in_scan_order(columns, indices, scores, head)


def _in_scan_order(columns: RequestColumns, indices: Ints, scores: np.ndarray, head: bool) -> Ints:
    seq, t_arr, score = columns.arrival_seq[indices], columns.t_arr_s[indices], scores[indices]
    keys = (seq, t_arr, -score) if head else (-seq, -t_arr, score)
    return indices[np.lexsort(keys)]  # stable: snapshot order breaks the remaining ties


def _eligible_victims(
    columns: RequestColumns,
    running: Ints,
    scores: np.ndarray,
    knobs: Knobs,
    over: np.ndarray | None = None,
) -> Ints:
    """Running requests the tail scan may rotate out when HBM is not short: VLT < 0, holding
    HBM blocks, resident, and past the guards the knobs switch on (the residency guard does
    not hold against a lagging request of a tighter class with ``residency_yields_to_tighter``,
    nor for an over-served tenant's request, ``over``, with per-tenant fairness;
    with ``tpot_lag`` a request's VLT counts its TPOT credit, so the guard lets go of one that
    can afford a pause)."""
    ok = (scores[running] < 0) & (columns.num_blocks_hbm[running] > 0) & columns.resident[running]
    if knobs.min_residency_s > 0:
        guarded = scores[running] >= -knobs.min_residency_s
        if knobs.residency_yields_to_tighter:
            looser = looser_than_lagging(columns, scores, knobs)
            if looser is not None:
                guarded &= ~looser[running]
        if over is not None:  # the tenant over its share waits: its residency is not owed
            guarded &= ~over[running]
        ok &= ~guarded
    if knobs.protect_unserved:
        t_last, t_run = columns.t_last_s[running], columns.t_run_s[running]
        ok &= ~np.isnan(t_last) & (np.isnan(t_run) | (t_last >= t_run))
    return running[ok]


def _tail_scan(
    snapshot: ColumnarSnapshot,
    running: Ints,
    growth: Ints,
    scores: np.ndarray,
    victims: Ints,
    owed: tuple[int, int, int],
    groups: ScanGroups,
) -> tuple[Ints, Ints]:
    """Step 4: from the tail of L (VLT ascending, later arrival first) while B_swap > 0 or a
    seat is owed, rotate out; each victim pays what it holds plus its growth (``owed``: B_swap,
    the seats owed, the HBM shortage). While HBM is short for the running requests' own growth
    (shortage > 0) any running request with VLT < 0 that holds resident blocks may go, guards
    or not. Victims go by ``groups``' tail groups: the worst priority band first, and within a
    band (per-tenant fairness) the over-served tenants' first. Returns (rotated out, preempted
    by recompute: forced victims DRAM has no room for, covered newest first)."""
    b_swap, seats_owed, shortage = owed
    columns = snapshot.requests
    credit = np.zeros(len(columns), np.int64)
    credit[running] = columns.num_blocks_hbm[running] + growth
    num_forced, forced = 0, EMPTY
    if shortage > 0:
        movable = (scores[running] < 0) & (columns.num_blocks_hbm[running] > 0)
        pool = running[movable & columns.resident[running]]
        bands = groups.bands(columns, pool)[::-1]  # the worst band first
        forced = _pay_in_turn(columns, bands, scores, credit, (min(shortage, b_swap), 0))
        num_forced = len(forced)
        paid = int(credit[forced].sum())
        b_swap, seats_owed = b_swap - paid, seats_owed - num_forced
        victims = victims[~np.isin(victims, forced)]
    tail_groups = groups.tail(columns, victims)
    taken = _pay_in_turn(columns, tail_groups, scores, credit, (b_swap, seats_owed))
    rotated, no_room = split_by_dram_room(snapshot, np.concatenate((forced, taken)), num_forced)
    if not len(no_room):
        return rotated, EMPTY
    uncovered = shortage - int(credit[rotated].sum())
    in_band_order = np.concatenate(groups.bands(columns, running))  # its newest: the worst's
    return rotated, recompute_newest(columns, in_band_order, rotated, uncovered)


def _pay_in_turn(
    columns: RequestColumns,
    groups: list[Ints],
    scores: np.ndarray,
    credit: Ints,
    owed: tuple[int, int],
) -> Ints:
    """:func:`_prefix_paying` over ``groups`` in turn until ``owed`` (blocks, seats) is paid."""
    blocks, seats = owed
    taken = EMPTY
    for group in groups:
        more = _prefix_paying(columns, group, scores, credit, blocks, seats)
        taken = np.concatenate((taken, more)) if len(taken) else more
        blocks, seats = blocks - int(credit[more].sum()), seats - len(more)
    return taken


def _prefix_paying(
    columns: RequestColumns,
    pool: Ints,
    scores: np.ndarray,
    credit: Ints,
    blocks: int,
    seats: int,
) -> Ints:
    """The shortest prefix of ``pool`` in tail order that pays ``blocks`` (each victim taken
    while blocks are still owed) and at least ``seats`` victims."""
    if (blocks <= 0 and seats <= 0) or not len(pool):
        return EMPTY
    expected = 2 * max(0, blocks) * len(pool) // max(1, int(credit[pool].sum())) + seats
    taken: list[Ints] = []
    for segment in _segments_of_l(columns, pool, scores, False, max(_SEGMENT, expected)):
        paid = credit[segment]
        before = np.cumsum(paid) - paid
        count = max(int(np.searchsorted(before, blocks, side="left")), seats)
        count = min(count, len(segment))
        taken.append(segment[:count])
        blocks, seats = blocks - int(paid[:count].sum()), seats - count
        if blocks <= 0 and seats <= 0:
            break
    return np.concatenate(taken) if len(taken) > 1 else taken[0]
