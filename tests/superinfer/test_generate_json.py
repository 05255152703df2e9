"""`superinfer generate --json` writes JSON lines, one per prompt, and nothing else on stdout:
its logs (kv_pool_sized...) go to stderr, so `| jq` and a reader of the first line work."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_json_output_is_json_only_on_stdout() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERINFER_")}
    command = [sys.executable, "-m", "superinfer", "generate", "--model", "tiny-random"]
    command += ["--prompt", "hello", "--prompt", "there", "--max-tokens", "3", "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [json.loads(line)["prompt"] for line in lines] == ["hello", "there"], done.stdout
    assert all(len(json.loads(line)["token_ids"]) == 3 for line in lines)
    logged = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert "kv_pool_sized" in {entry.get("event") for entry in logged}, done.stderr[-3000:]
