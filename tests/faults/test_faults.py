"""Fault injection with the real services as processes: what breaks, and that no request is
silently lost or left hanging (each test prints its numbers). Outcomes are judged as
tests/faults/support.py defines them: a transport error is never a "clear error"."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from tests.faults.conftest import WORKER_ARGS, MakeSystem
from tests.faults.support import (
    ADMIN_TOKEN,
    DEADLINE_S,
    Load,
    Outcome,
    RedisProcess,
    System,
    exact_tokens,
    failure_kinds,
    summary,
    wait_for,
)

# A request that fails because of a fault is told so within this long after the fault is
# over (Redis back, the worker's death noticed): seconds on an idle machine (the gateway
# notices a silent worker after SUPERINFER_WORKER_DEAD_S = 3 s), with room for a busy host.
FAILURE_REPORTED_S = 20.0


def _plan_source(system: System) -> str:
    (worker,) = system.workers()
    return str(worker["plan_source"])


def _one_request_ok(system: System) -> bool:
    body = {"prompt": "Once", "max_tokens": 4}
    return httpx.post(f"{system.url}/v1/completions", json=body, timeout=30).status_code == 200


def _gateway_ready(system: System) -> bool:
    return httpx.get(f"{system.url}/ready", timeout=10).status_code == 200


def _failures(outcomes: list[Outcome]) -> str:
    """The requests that did not complete, the lost ones first."""
    failed = sorted((o for o in outcomes if not o.completed), key=lambda o: not o.lost)
    return "; ".join(("LOST " if o.lost else "") + o.describe() for o in failed)[:3000]


async def test_r2_control_plane_killed_under_load(system: System) -> None:
    t_start = time.monotonic()
    load = Load(system.url, 8, 64).start()
    await wait_for(lambda: _plan_source(system) == "remote", "the worker runs remote plans")
    await wait_for(lambda: load.count(lambda o: o.completed) >= 8, "the load flows")
    t_kill = time.monotonic()
    system.kill("control-plane")
    t_local_s = await wait_for(lambda: _plan_source(system) == "local", "the worker plans alone")
    system.start("control-plane")
    t_remote_s = await wait_for(lambda: _plan_source(system) == "remote", "remote plans again")
    t_back = time.monotonic()
    await wait_for(lambda: load.num_completed_after(t_back) >= 8, "requests after the restart")
    outcomes = await load.finish()
    print(
        f"R2: {summary(outcomes)}; killed {t_kill - t_start:.1f} s into the load, local plans "
        f"{t_local_s:.1f} s after the kill, remote again {t_remote_s:.1f} s after the restart, "
        f"load over {time.monotonic() - t_back:.1f} s after that"
    )
    assert all(o.completed for o in outcomes), _failures(outcomes)
    assert not exact_tokens(outcomes, 64)


async def _until_every_request_streams(load: Load, timeout_s: float = DEADLINE_S) -> None:
    """Until the load has flowed (8 completed) and every request in flight has had its first
    token. Checked on the event loop, so nothing new starts before the caller's next await."""
    deadline = time.monotonic() + timeout_s
    while True:
        in_flight = [o for o in load.outcomes if not o.t_end_s]
        if (
            load.count(lambda o: o.completed) >= 8
            and in_flight
            and all(o.t_first_token_s is not None for o in in_flight)
        ):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("no moment with every request streaming")
        await asyncio.sleep(0.01)


async def test_r3_redis_restart_under_load(system: System, redis_process: RedisProcess) -> None:
    """Redis (no persistence, like a cache-only deployment) restarts empty while every request
    in flight streams. Known gap, not tested here: a request accepted but not yet read by its
    worker when Redis loses its data is answered only by the gateway's token timeout (a busy
    host widens that window; it was this test's intermittent failure)."""
    load = Load(system.url, 8, 64).start()
    await _until_every_request_streams(load)
    redis_process.kill()
    t_killed = time.monotonic()
    # Down until the gateway has noticed (it is no longer ready), and at least a second.
    await wait_for(lambda: not _gateway_ready(system), "the gateway notices Redis is gone")
    await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t_killed)))
    redis_process.start()
    t_back = time.monotonic()
    recovered_s = await wait_for(lambda: _one_request_ok(system), "a new request succeeds")
    t_recovered = time.monotonic()
    await wait_for(lambda: load.num_completed_after(t_recovered) >= 8, "the load recovers")
    outcomes = await load.finish()
    failed = [o for o in outcomes if not o.completed]
    late_s = max((o.t_end_s - t_back for o in failed), default=0.0)
    print(
        f"R3: Redis down {t_back - t_killed:.1f} s; {summary(outcomes)} (failed: "
        f"{failure_kinds(outcomes)}); the last failed one ended {late_s:.1f} s after Redis was "
        f"back; new requests succeed {recovered_s:.1f} s after that"
    )
    assert not [o for o in outcomes if o.lost], _failures(outcomes)
    assert not exact_tokens(outcomes, 64)  # none silently short
    assert late_s <= FAILURE_REPORTED_S


def _requests_in_flight_without_tokens(system: System, worker_id: str) -> bool:
    status = system.worker(worker_id)
    return bool(status["alive"] and status["num_running"] > 0 and status["num_waiting"] > 0)


def _unstarted_on(system: System, load: Load, worker_id: str) -> set[str]:
    """The requests in flight without a token that the gateway submitted to ``worker_id``
    (its ``request_submitted`` log lines; none of these tests moves one before the kill)."""
    submitted = {
        e["request_id"]
        for e in system.events("gateway", "request_submitted")
        if e["worker_id"] == worker_id
    }
    return {
        o.request_id
        for o in load.outcomes
        if o.request_id in submitted and o.t_first_token_s is None and not o.t_end_s
    }


async def _kill_holding_unstarted(system: System, load: Load, worker_id: str) -> set[str]:
    """SIGKILL ``worker_id`` at a moment it holds requests without a token; their ids. The
    worker is frozen (SIGSTOP) while that is checked, far shorter than the gateway's dead-worker
    wait, and let go on again when it holds none: a heartbeat's count can be half a second old,
    and on a busy host its waiting requests may all have started by the kill."""
    process = system.processes[worker_id]
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        process.send_signal(signal.SIGSTOP)
        # outputs it wrote before the stop reach their clients (0.3 s was short under load in
        # CI: every "unstarted" request turned out to have had a token at the gateway)
        await asyncio.sleep(0.8)
        unstarted = _unstarted_on(system, load, worker_id)
        if unstarted:
            system.kill(worker_id)
            return unstarted
        process.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{worker_id} never held a request without a token")


async def test_r4_worker_killed_under_load(system: System) -> None:
    """Two workers, more clients than they run at once (each also has requests waiting for a
    slot); w0 is killed and the clients send nothing new (what was in flight plays out). w0's
    requests with tokens already sent fail with a clear 503, those without any move to w1 and
    must then stream exactly their tokens; nothing on w1 fails."""
    system.start("w1")
    await wait_for(lambda: len([w for w in system.workers() if w["alive"]]) == 2, "w1 joins")
    load = Load(system.url, 40, 64).start()
    await wait_for(
        lambda: load.count(lambda o: o.t_first_token_s is not None and not o.t_end_s) >= 8,
        "requests stream",
    )
    await wait_for(
        lambda: all(_requests_in_flight_without_tokens(system, w) for w in ("w0", "w1")),
        "both workers run requests and have more waiting",
        interval_s=0.05,
    )
    unstarted_ids = await _kill_holding_unstarted(system, load, "w0")
    t_killed = time.monotonic()
    # No new load: w1 alone cannot keep up with 40 clients, and new arrivals served ahead of
    # the moved requests would only measure its queueing (on a busy host, for minutes).
    load.stop()
    outcomes = await load.finish()
    recovered_s = await wait_for(lambda: _one_request_ok(system), "a new request succeeds")
    moved_ids = {e["request_id"] for e in system.events("gateway", "request_moved")}
    moved = [o for o in outcomes if o.request_id in moved_ids]
    failed = [o for o in outcomes if not o.completed]
    lost = [o for o in failed if o.error_code == "worker_lost"]
    refused = [o for o in failed if o.status == 429 and o.error_code == "queue_full"]
    late_s = max((o.t_end_s - t_killed for o in lost), default=0.0)
    print(
        f"R4: {summary(outcomes)} (failed: {failure_kinds(outcomes)}); {len(moved)} moved to "
        f"w1, {len(lost)} lost with w0 (clear 503 errors, the last {late_s:.1f} s after the "
        f"kill), {len(refused)} refused with 429 20 times in a row; then a new request "
        f"succeeded within {recovered_s:.1f} s"
    )
    assert failed, "the killed worker had requests in flight"
    assert all(o.clear_error for o in failed), _failures(outcomes)
    assert lost and len(lost) + len(refused) == len(failed), _failures(outcomes)  # none on w1
    assert late_s <= FAILURE_REPORTED_S
    # Moved requests: streamed from w1 only, every token exactly once.
    # A request w0 held without a token for its client either moved, or the gateway had a token
    # of it already (in flight to the client, or held by the detokenizer mid-character): then it
    # ended with the clear error, like those streaming.
    by_id = {o.request_id: o for o in outcomes}
    stayed = [by_id[i] for i in unstarted_ids - moved_ids]
    assert all(o.error_code == "worker_lost" for o in stayed), _failures(stayed)
    assert moved, "w0 had requests without a token when it was killed: they must move"
    assert all(o.completed for o in moved), _failures(moved)
    assert not exact_tokens(outcomes, 64)


async def test_worker_sigterm_drains_under_load(make_system: MakeSystem) -> None:
    """A worker stopped with SIGTERM while serving (a rolling update, a node drain) finishes
    what it runs, takes nothing new, and exits 0; every request completes with all its tokens
    (those that reached w0 after the signal move to w1 when w0 has left)."""
    drain_timeout_s = 2 * DEADLINE_S  # the worker's own limit is not what is tested here
    system = make_system({"SUPERINFER_DRAIN_TIMEOUT_S": str(drain_timeout_s)})
    system.start("w1")
    await wait_for(lambda: len([w for w in system.workers() if w["alive"]]) == 2, "w1 joins")
    load = Load(system.url, 12, 64).start()
    await wait_for(
        lambda: all(system.worker(w)["num_running"] > 0 for w in ("w0", "w1")),
        "both workers run requests",
        interval_s=0.05,
    )
    t_term = time.monotonic()
    exit_code = await asyncio.to_thread(system.kill, "w0", signal.SIGTERM, drain_timeout_s + 60)
    drain_s = time.monotonic() - t_term
    t_exit = time.monotonic()
    await wait_for(lambda: load.num_completed_after(t_exit) >= 8, "w1 serves the load")
    outcomes = await load.finish()
    in_flight = [o for o in outcomes if o.t_start_s < t_term < o.t_end_s]
    print(
        f"SIGTERM drain: {summary(outcomes)}; w0 exited {exit_code} after {drain_s:.1f} s; "
        f"{len(in_flight)} requests were in flight at the signal"
    )
    assert exit_code == 0
    assert system.events("w0", "worker_draining")
    assert not system.events("w0", "worker_drain_timed_out")
    assert in_flight and all(o.completed for o in in_flight), _failures(in_flight)
    assert all(o.completed for o in outcomes), _failures(outcomes)
    assert not exact_tokens(outcomes, 64)


async def test_a_gateway_frozen_past_gateway_dead_s_loses_nothing(make_system: MakeSystem) -> None:
    """A gateway process frozen (SIGSTOP: a paused VM, swapping) longer than the workers'
    gateway_dead_s: its running requests are aborted, each with an error on its output stream,
    which the workers no longer delete. Thawed, it delivers what finished meanwhile and fails
    the aborted ones at once (they waited the whole token timeout, then got a 504)."""
    system = make_system({"SUPERINFER_GATEWAY_DEAD_S": "1.5"})
    load = Load(system.url, 4, 3000).start()  # long enough to be running at the sweep
    await wait_for(lambda: system.worker("w0")["num_running"] > 0, "w0 runs", interval_s=0.05)
    gateway = system.processes["gateway"]
    gateway.send_signal(signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        await wait_for(lambda: bool(system.events("w0", "orphans_aborted")), "w0 sweeps")
    finally:
        load.stop()  # the requests in flight are what is judged
        gateway.send_signal(signal.SIGCONT)
    t_thaw = time.monotonic()
    outcomes = await load.finish()
    await wait_for(lambda: _one_request_ok(system), "the thawed gateway serves")
    frozen = [o for o in outcomes if o.t_start_s < t_stop]
    print(
        f"gateway frozen {t_thaw - t_stop:.1f} s: {summary(frozen)} of those sent before; "
        f"ended within {max(o.t_end_s for o in frozen) - t_thaw:.1f} s of the thaw"
    )
    assert frozen and not [o for o in frozen if o.lost], _failures(frozen)
    assert all(o.t_end_s - t_thaw < FAILURE_REPORTED_S for o in frozen), _failures(frozen)
    aborted = [o for o in frozen if o.clear_error]
    assert all(o.error_code == "gateway_stalled" for o in aborted), _failures(aborted)
    (sweep,) = system.events("w0", "orphans_aborted")
    assert len(aborted) == len(sweep["request_ids"])  # each aborted one told, the rest done


def test_password_redis_and_secrets_never_logged() -> None:
    """A Redis that needs a password (given in the URL); the admin token and the password never
    appear in any service's log."""
    redis_process = RedisProcess(password="s3cret-redis-pw")
    redis_process.start()
    system = System(redis_process, "tiny-random", WORKER_ARGS)
    try:
        for name in ("control-plane", "w0", "gateway"):
            system.start(name)
        system.wait_ready()
        assert _one_request_ok(system)
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        put = httpx.put(
            f"{system.url}/admin/v1/knobs", json={"alpha": 2}, headers=headers, timeout=30
        )
        assert put.status_code == 200
        wrong = httpx.put(f"{system.url}/admin/v1/knobs", json={"alpha": 2}, timeout=30)
        assert wrong.status_code == 401
    finally:
        system.stop_all()
        redis_process.kill()
    logs = "".join(path.read_text() for path in system.logs.glob("*.log"))
    assert "request_submitted" in logs  # the services did log
    assert ADMIN_TOKEN not in logs and "s3cret-redis-pw" not in logs
