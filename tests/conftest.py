from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

with contextlib.suppress(ImportError):  # the GPU machine has no redis client
    from tests.redis_support import redis_client  # noqa: F401 - a fixture for every test

# The kit beside the checkout (../shared); SUPERINFER_KIT points elsewhere (the GPU machine).
# Tiny models on a shared 2-core machine: OpenMP worker threads that spin-wait starve the
# DuplexKV copy threads (measured: one rotation schedule 16.7 s with 2 threads, 0.9 s with 1).
torch.set_num_threads(1)

SHARED = Path(os.environ.get("SUPERINFER_KIT", Path(__file__).resolve().parents[2] / "shared"))
STORIES_DIR = SHARED / "models" / "stories260K"
STORIES_REFERENCE_TOKENS = [
    403,
    407,
    261,
    378,
    432,
    383,
    286,
    261,
    376,
    298,
    315,
    421,
    395,
    317,
    426,
    338,
]
STORIES_REFERENCE_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    " One day, she saw a big, red ball."
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def stories_path() -> Path:
    path = STORIES_DIR / "stories260K.bin"
    if not path.exists():
        pytest.skip("../shared/models/stories260K is not present")
    return path
