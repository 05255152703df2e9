"""`superinfer serve` when a part of it dies, as real processes and real signals: its embedded
Redis killed under a stream (the stream ends with a ``bus`` error within 5 s, serve exits 1
within seconds, leaving no child), serve itself SIGKILLed as the OOM killer does (no child and
no redis-server outlives it by 5 s), and a gateway's /health telling that its bus is lost."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from tests.faults.support import RedisProcess
from tests.served import free_port, wait_ready

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
STREAM_ENDS_S = 5.0  # the promise: a stream in flight ends this soon after Redis is gone
SERVE_EXITS_S = 10.0  # "within seconds" (about 3 s measured), with room for a busy host
CHILDREN_GONE_S = 5.0


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERINFER_")}
    env["SUPERINFER_ADMIN_TOKEN"] = "serve-faults-admin"
    return env


@contextmanager
def _process(
    command: list[str], log: Path, env: dict[str, str]
) -> Iterator[tuple[subprocess.Popen[str], list[psutil.Process]]]:
    """``superinfer <command>``, logging to ``log``, and a list for the test to add what it
    finds to; at the end all of them are killed (and its children, if it still runs)."""
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "superinfer", *command],
            env=env,
            stdout=out,
            stderr=out,
            text=True,
        )
    found: list[psutil.Process] = []
    try:
        yield process, found
    finally:
        found += _descendants(process.pid)
        if process.poll() is None:
            process.kill()
            process.wait()
        for other in found:
            with contextlib.suppress(psutil.NoSuchProcess):
                other.kill()


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _children_by_role(pid: int) -> dict[str, psutil.Process]:
    """serve's children: "redis", "control-plane", "data-plane" (those found so far)."""
    found = {}
    for child in _descendants(pid):
        try:
            with_args = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        for role in ("redis-server", "control-plane", "data-plane"):
            if role in with_args:
                found[role] = child
    return found


def _wait(predicate: object, what: str, timeout_s: float) -> float:
    """Seconds until ``predicate()`` held; AssertionError naming ``what`` after ``timeout_s``."""
    t_start = time.monotonic()
    while not predicate():  # type: ignore[operator]
        if time.monotonic() - t_start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.05)
    return time.monotonic() - t_start


def _stream_until_redis_killed(url: str, redis_server: psutil.Process) -> tuple[float, str]:
    """Stream a long completion, SIGKILL ``redis_server`` at its first token; seconds from the
    kill to the stream's end, and its last data line before [DONE]."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hello", "max_tokens": 2000, "stream": True}
    body["ignore_eos"] = True
    t_kill, last = None, ""
    timeout = httpx.Timeout(30.0, read=2 * STREAM_ENDS_S)  # the old code's stream outlived it
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():  # keep-alives too: the deadline is checked on each
            if t_kill is not None and time.monotonic() - t_kill > 2 * STREAM_ENDS_S:
                break
            if not line.startswith("data: "):
                continue
            if t_kill is None:
                redis_server.send_signal(signal.SIGKILL)
                t_kill = time.monotonic()
            if line != "data: [DONE]":
                last = line
    if t_kill is None:
        raise AssertionError("the stream sent nothing")
    return time.monotonic() - t_kill, last


def test_redis_killed_under_serve_ends_streams_and_serve(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = ["serve", "--model", "tiny-random", "--port", str(port)]
    with _process(command, log, _env()) as (serve, found):
        wait_ready(url, serve, log, timeout_s=180)
        children = list(_children_by_role(serve.pid).values())
        redis_servers = _redis_processes(_children_by_role(serve.pid)["data-plane"])
        found += children + redis_servers
        assert len(redis_servers) == 1, redis_servers
        ended_s, last = _stream_until_redis_killed(url, redis_servers[0])
        t_ended = time.monotonic()
        error = json.loads(last.removeprefix("data: ")).get("error") or {}
        assert error.get("code") == "bus", f"no bus error in {2 * STREAM_ENDS_S:g} s: {last}"
        assert ended_s < STREAM_ENDS_S
        serve.wait(timeout=SERVE_EXITS_S + 30)
        exited_s = ended_s + time.monotonic() - t_ended
        left = [c for c in children if _running(c)]
    print(
        f"serve, its Redis killed: the stream ended {ended_s:.2f} s after the kill ({last}); "
        f"serve exited {exited_s:.2f} s after the kill with {serve.returncode}"
    )
    assert serve.returncode == 1 and exited_s < SERVE_EXITS_S
    assert "the embedded Redis exited" in log.read_text()
    assert not left, left


def _redis_processes(worker: psutil.Process) -> list[psutil.Process]:
    """Every process naming the directory of ``worker``'s Redis socket (the embedded Redis,
    however it was started)."""
    redis_url = worker.environ()["SUPERINFER_REDIS_URL"]
    directory = os.path.dirname(redis_url.removeprefix("unix://"))
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(directory in arg for arg in process.info["cmdline"] or ()):
            found.append(process)
    return found


def test_serve_sigkilled_leaves_no_child(tmp_path: Path) -> None:
    """SIGKILL (nothing of serve runs after it): its control plane, worker and Redis die too."""
    command = ["serve", "--model", "tiny-random", "--port", str(free_port())]
    with _process(command, tmp_path / "serve.log", _env()) as (serve, found):
        roles = ("control-plane", "data-plane")
        _wait(lambda: set(roles) <= set(_children_by_role(serve.pid)), "children started", 120)
        children = _children_by_role(serve.pid)
        watched = {*children.values(), *_redis_processes(children["data-plane"])}
        found += watched
        assert len(watched) == 3, watched  # control plane, worker, redis-server
        serve.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        serve.wait()
        gone, alive = psutil.wait_procs(watched, timeout=CHILDREN_GONE_S)
        gone_s = time.monotonic() - t_kill
        alive = [p for p in alive if _running(p)]
    print(f"serve SIGKILLed: {len(gone)} children gone within {gone_s:.2f} s, alive: {alive}")
    assert not alive, alive


def _running(process: psutil.Process) -> bool:
    """Running and not a zombie (an exited process its reaper has not collected yet)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_gateway_health_tells_a_lost_bus(tmp_path: Path) -> None:
    """/health stays 200 (a restart cannot bring Redis back) and says ``bus_lost`` while the
    gateway's Redis is gone; ``ok`` again once Redis is back."""
    redis_process = RedisProcess()
    redis_process.start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**_env(), "SUPERINFER_REDIS_URL": redis_process.url}
    command = ["gateway", "--port", str(port), "--model", "tiny-random"]
    try:
        with _process(command, tmp_path / "gateway.log", env) as (gateway, _):

            def health() -> str:
                if gateway.poll() is not None:
                    raise AssertionError(f"the gateway exited with {gateway.returncode}")
                with httpx.Client(timeout=2) as client:
                    try:
                        response = client.get(f"{url}/health")
                    except httpx.HTTPError:
                        return "unreachable"
                assert response.status_code == 200, response.text
                return str(response.json()["status"])

            _wait(lambda: health() == "ok", "the gateway up", 120)
            redis_process.kill()
            lost_s = _wait(lambda: health() == "bus_lost", "/health telling", STREAM_ENDS_S)
            assert httpx.get(f"{url}/ready", timeout=5).status_code == 503
            redis_process.start()
            back_s = _wait(lambda: health() == "ok", "/health ok again", 30)
    finally:
        redis_process.kill()
    print(f"/health: bus_lost {lost_s:.2f} s after Redis was killed, ok {back_s:.2f} s after back")


def test_ctrl_c_stops_serve_cleanly_and_lets_streams_finish(tmp_path: Path) -> None:
    """A terminal's Ctrl-C signals the whole foreground process group: Redis died first, the
    stream in flight ended in a ``bus`` error, error lines were logged and serve exited 1."""
    port = free_port()
    command = [sys.executable, "-m", "superinfer", "serve", "--model", "tiny-random"]
    log = tmp_path / "serve.log"
    with log.open("w") as out:  # its own group, as a shell's foreground job
        serve = subprocess.Popen(
            [*command, "--port", str(port)], env=_env(), stdout=out, stderr=out,
            start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, serve, log)
        body = {"model": "tiny-random", "prompt": "hello", "max_tokens": 300, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # streaming now
            os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C: the group, children included
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2], rest[-2:]
        assert serve.wait(timeout=60) == 0
        assert '"level": "error"' not in log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(serve.pid, signal.SIGKILL)
