"""The worker's CPU thread policy (llama.cpp's ``-t``): how many threads torch's kernels use.

OpenMP's wait policy is left at libgomp's default: an idle thread spins for a bounded count
(``GOMP_SPINCOUNT``) and then sleeps, so it never holds a core the gateway, the control plane or
Redis need for long. ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once) cost 30-45 % of decode speed on
two cores (docs/benchmarks.md), so it is not set; an operator may still set it."""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, as a container's cpuset sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def apply_thread_policy(threads: int | None) -> int:
    """Set torch's intra-op threads to ``threads`` (None: every available core); returns it."""
    num_threads = threads if threads is not None else available_cores()
    if num_threads < 1:
        raise ValueError(f"--threads {num_threads}: must be at least 1")
    torch.set_num_threads(num_threads)
    return num_threads
