"""The endpoints the Helm probes and Prometheus use, on the real services (data_plane.main and
control_plane.main serve) over a real Redis: /ready follows model load and Redis, /metrics has
the services' metrics, a stopped worker drains what it owns, the control plane seeds knobs and
SLO classes from its settings (the chart's ConfigMap)."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from redis.asyncio import Redis

from control_plane.main import serve as serve_control_plane
from control_plane.settings import ControlPlaneSettings
from data_plane.main import WorkerState, _run_and_drain
from data_plane.main import serve as serve_worker
from data_plane.settings import WorkerSettings
from shared import streams
from shared.errors import ConfigError
from shared.knobs import read_knobs, write_knobs
from shared.policy import Knobs
from shared.protocol import SubmitRequest, TokenOutputs, decode, encode
from shared.sampling import SamplingParams
from shared.slo import read_slo_classes
from tests.redis_support import redis_url

REPLY = "superinfer:gateway:probe-test:outputs"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_status(client: httpx.AsyncClient, url: str, status: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = (await client.get(url)).status_code
            if last == status:
                return
        except httpx.TransportError as exc:
            last = exc
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url}: wanted {status}, last {last!r}")


async def test_worker_probes_metrics_and_drain(redis_client: Redis) -> None:
    port = free_port()
    settings = WorkerSettings(
        worker_id="probe-w0",
        redis_url=redis_url(),
        model="tiny-random",
        hbm_kv_gib=0.01,
        health_port=port,
        health_host="127.0.0.1",
        idle_block_ms=20,
        drain_timeout_s=20.0,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(serve_worker(settings, stop))
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        await wait_status(client, "/ready", 200, 60)
        assert (await client.get("/health")).status_code == 200
        metrics = (await client.get("/metrics")).text
        assert 'superinfer_worker_ready{worker_id="probe-w0"} 1.0' in metrics
        assert "superinfer_worker_iterations_total" in metrics
        assert 'superinfer_worker_kv_blocks{tier="hbm",worker_id="probe-w0"}' in metrics
        assert 'superinfer_worker_b_xfer_blocks{worker_id="probe-w0"} 0.0' in metrics  # no DRAM
        # vLLM's engine series, as a vLLM server exports its engine's (labels model_name, engine)
        engine = 'engine="probe-w0",model_name="tiny-random"'
        assert f"vllm:num_requests_running{{{engine}}} 0.0" in metrics
        assert f"vllm:prefix_cache_queries_total{{{engine}}} " in metrics  # warm-up: not 0

        request = SubmitRequest(
            request_id="drain-1",
            prompt_token_ids=[72, 101, 108, 108, 111],
            reply_stream=REPLY,
            t_arr_s=time.time(),
            sampling=SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        )
        await redis_client.xadd(streams.worker_requests_stream("probe-w0"), {"m": encode(request)})
        deadline = time.monotonic() + 20
        while not await redis_client.xlen(REPLY) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        stop.set()  # SIGTERM mid-request: the worker finishes it before exiting
        await asyncio.wait_for(task, 30)

    tokens: list[int] = []
    finish = None
    entries: Any = await redis_client.xrange(REPLY)
    for _, fields in entries:
        for out in decode(fields[b"m"], TokenOutputs).outputs:
            tokens += out.token_ids
            finish = out.finish_reason or finish
    assert len(tokens) == 40 and finish == "length"
    # Its streams outlive it by stopped_streams_ttl_s only (nobody else deletes them once it
    # left the workers hash); a worker of the same id starting again keeps them.
    own = [streams.worker_requests_stream("probe-w0"), streams.worker_plans_stream("probe-w0")]
    ttl_s = settings.stopped_streams_ttl_s
    assert 0 < await redis_client.ttl(own[0]) <= ttl_s
    await redis_client.xadd(own[1], {"m": b"x"})  # plans, as a control plane would publish
    again = asyncio.create_task(serve_worker(settings, stop := asyncio.Event()))
    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        await wait_status(client, "/ready", 200, 60)
    assert [await redis_client.ttl(s) for s in own] == [-1, -1]  # persisted
    stop.set()
    await asyncio.wait_for(again, 30)
    assert all([0 < await redis_client.ttl(s) <= ttl_s for s in own])


async def test_worker_not_ready_without_redis() -> None:
    port = free_port()
    settings = WorkerSettings(
        worker_id="probe-w1",
        redis_url="redis://127.0.0.1:1/0",
        model="tiny-random",
        hbm_kv_gib=0.01,
        health_port=port,
        health_host="127.0.0.1",
    )
    stop = asyncio.Event()
    task = asyncio.create_task(serve_worker(settings, stop))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            await wait_status(client, "/health", 200, 60)
            await asyncio.sleep(0.3)
            assert (await client.get("/ready")).status_code == 503
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


class FakeEngine:
    def __init__(self, busy_for: int) -> None:
        self.busy_for = busy_for

    def has_unfinished(self) -> bool:
        self.busy_for -= 1
        return self.busy_for > 0


class FakeWorker:
    def __init__(self, busy_for: int) -> None:
        self.engine = FakeEngine(busy_for)
        self.stopped_with_work = False
        self.draining = False  # the Worker's flag, which the health state reads

    def has_unfinished(self) -> bool:  # the Worker's: the engine's, and compiling grammars
        return self.engine.has_unfinished()

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.stopped_with_work = self.engine.busy_for > 0


@pytest.mark.parametrize(
    ("busy_for", "timeout_s", "cut_short"), [(5, 10.0, False), (10**9, 0.2, True)]
)
async def test_drain_waits_for_the_engine_or_the_timeout(
    busy_for: int, timeout_s: float, cut_short: bool
) -> None:
    worker: Any = FakeWorker(busy_for)
    state = WorkerState("w")
    state.worker = worker  # as main() does once the model is loaded
    stop = asyncio.Event()
    task = asyncio.create_task(_run_and_drain(worker, state, stop, timeout_s))
    await asyncio.sleep(0.05)
    assert not state.draining
    stop.set()
    await asyncio.wait_for(task, 5)
    assert state.draining
    assert worker.stopped_with_work is cut_short


async def test_control_plane_probes_and_config_seeding(redis_client: Redis) -> None:
    port = free_port()
    knobs = {"policy": "lvf", "b_xfer": "auto", "alpha": 2.0}
    classes = {"gold": {"ttft_s": 0.5, "tbt_s": 0.04}, "bulk": {"ttft_s": 30, "tbt_s": 0.5}}

    async def run_once(overwrite: bool, policy: str) -> None:
        settings = ControlPlaneSettings(
            redis_url=redis_url(),
            health_port=port,
            health_host="127.0.0.1",
            read_block_ms=20,
            knobs={**knobs, "policy": policy},
            slo_classes=classes,
            config_overwrite=overwrite,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(serve_control_plane(settings, stop))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            await wait_status(client, "/ready", 200, 20)
            deadline = time.monotonic() + 10
            while (await read_knobs(redis_client))[1] == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            metrics = (await client.get("/metrics")).text
            assert "superinfer_control_plane_plans_total" in metrics
            assert "superinfer_control_plane_knobs_version" in metrics
            assert "superinfer_control_plane_plans_fenced_total 0.0" in metrics
            assert "superinfer_control_plane_live_replicas" in metrics
            assert "superinfer_control_plane_snapshot_base_missing_total 0.0" in metrics
        stop.set()
        await asyncio.wait_for(task, 10)

    await run_once(overwrite=False, policy="lvf")
    current, version = await read_knobs(redis_client)
    assert (current.policy, current.b_xfer, current.alpha, version) == ("lvf", None, 2.0, 1)
    seeded, _ = await read_slo_classes(redis_client)
    assert sorted(seeded) == ["bulk", "gold"] and seeded["gold"].ttft_s == 0.5

    await write_knobs(redis_client, {"policy": "edf", "beta_f": 13.0})  # the admin API's path
    await run_once(overwrite=False, policy="lvf")  # a restart keeps it
    assert (await read_knobs(redis_client))[0].policy == "edf"
    await run_once(overwrite=True, policy="swap")  # config_overwrite: the settings win
    overwritten = (await read_knobs(redis_client))[0]
    assert (overwritten.policy, overwritten.alpha) == ("swap", 2.0)
    assert overwritten.beta_f == Knobs().beta_f  # replaced, not merged: the default again


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"knobs": {"policy": "nope"}}, "policy"),
        ({"slo_classes": {"x": {"ttft_s": 0.0001, "tbt_s": 1.0}}}, "ttft_s 0.0001 is out of"),
        ({"slo_classes": {"x": {"ttft_s": 1.0, "tbt_s": 1e9}}}, "tbt_s"),
        ({"slo_classes": {}}, "at least one SLO class"),
    ],
)
async def test_control_plane_rejects_bad_config_before_writing(
    redis_client: Redis, config: dict[str, Any], match: str
) -> None:
    """The admin API's ranges hold for the settings too (an SLO class of 0.1 ms was written)."""
    settings = ControlPlaneSettings(redis_url=redis_url(), **config)
    with pytest.raises(ConfigError, match=match):
        await serve_control_plane(settings, asyncio.Event())
    assert (await read_knobs(redis_client))[1] == 0
    assert (await read_slo_classes(redis_client))[1] == 0


def test_a_lease_renewed_no_sooner_than_it_expires_is_refused() -> None:
    with pytest.raises(ValidationError, match="a third of lease_ttl_ms"):
        ControlPlaneSettings(lease_renew_s=6.0)
    assert ControlPlaneSettings(lease_ttl_ms=1000, lease_renew_s=0.3).lease_renew_s == 0.3
