from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.served import Served, embedded_redis, serve


@pytest.fixture(scope="package")
def served(stories_path: Path) -> Iterator[Served]:
    """stories260K behind the whole system; 4 sequences at a time, so tests can fill it."""
    with embedded_redis() as redis_url:
        args = ["--model", str(stories_path), "--block-size", "4", "--max-num-seqs", "4"]
        with serve(args, redis_url) as system:
            yield system
