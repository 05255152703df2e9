"""A setting or model a service cannot start with is one ``error:`` line and status 2, as
``generate`` answers it (``serve`` printed 139 lines of tracebacks for a model not in the
cache), and ``serve`` refuses a missing model before it starts any child."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import STORIES_DIR
from tests.served import free_port


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SUPERINFER_")}
    return subprocess.run(
        [sys.executable, "-m", "superinfer", *args],
        env={**clean, "HF_HUB_OFFLINE": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["serve", "--model", "/nowhere/model.gguf"], {}, "/nowhere/model.gguf"),
        (["serve", "--model", "no-such-org/no-such-model"], {}, "not in the local cache"),
        (["data-plane", "--model", str(STORIES_DIR / "stories260K.bin"), "--max-model-len",
          "4096"], {}, "--max-model-len"),
        (["gateway", "--model", str(STORIES_DIR / "stories260K.bin")], {}, "admin token"),
        # worker settings out of range: refused before the weights load (were tracebacks after)
        (["data-plane", "--model", "tiny-random", "--gpu-memory-utilization", "1.5"], {},
         "gpu_memory_utilization"),
        (["data-plane", "--model", "tiny-random", "--swap-space", "2", "--dram-kv-gib", "1"], {},
         "both size the host KV tier"),
        (["data-plane", "--model", "tiny-random", "--policy", "foo"], {}, "policy"),
        # ... and by serve before any child (the embedded Redis included)
        (["serve", "--model", "tiny-random", "--block-size", "0"], {}, "block_size"),
        (["serve", "--model", "tiny-random", "--policy", "foo"], {}, "'foo' is not one of"),
        (["serve", "--model", "tiny-random", "--port", "0"], {}, "--port 0"),
        (["serve", "--model", "tiny-random", "--chat-template", "/no/such.jinja"], {},
         "neither an existing file nor a jinja2 template"),
        (["serve", "--model", "tiny-random"], {"SUPERINFER_MAX_NUM_SEQS": "0"}, "max_num_seqs"),
        # a GPU this machine lacks, a CUDA copy engine without one (were tracebacks)
        *([(["data-plane", "--model", "tiny-random", "--device", "cuda"], {},
            "sees no CUDA device"),
           (["serve", "--model", "tiny-random", "--device", "cuda"], {}, "sees no CUDA device")]
          if not torch.cuda.is_available() else []),
        (["data-plane", "--model", "tiny-random", "--device", "cuda:x"], {}, "not a device"),
        (["data-plane", "--model", "tiny-random", "--transfer-backend", "cuda"], {},
         "transfer_backend cuda"),
        (["control-plane"], {"SUPERINFER_SLO_CLASSES": '{"x": {"ttft_s": -1, "tbt_s": 1}}'},
         "ttft_s -1 is out of"),
        (["control-plane", "--lease-renew-s", "6"], {}, "a third of lease_ttl_ms"),
        (["gateway", "--model", str(STORIES_DIR / "stories260K.bin")],
         {"SUPERINFER_ADMIN_TOKEN": "short"}, "at least 16 characters"),
    ],
)  # fmt: skip
def test_a_service_that_cannot_start_says_why_in_one_line(
    args: list[str], env: dict[str, str], says: str, tmp_path: Path
) -> None:
    done = _run([*args, "--redis-url", "redis://127.0.0.1:1/0"] if args[0] != "serve" else args,
                env)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors and says in errors[0], done.stderr[-2000:]


def test_serve_not_ready_in_time_exits_1() -> None:
    """It printed its error and exited 0: a supervisor took the failed start for a clean stop."""
    port = str(free_port())  # a worker cannot load and warm up in 0.2 s
    done = _run(["serve", "--model", "tiny-random", "--port", port, "--ready-timeout-s", "0.2"], {})
    assert done.returncode == 1, done.stderr[-2000:]
    assert "error: not ready after 0.2 s" in done.stderr
