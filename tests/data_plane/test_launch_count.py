"""Kernel launches of one decode step on the Triton path, per decoder layer: an 8B-shaped model
(Llama-3-8B's hidden, heads and MLP; two layers, a small vocabulary) in bf16.

With CUDA the launches are the profiler's CUDA kernels. Without, the same step runs in Triton's
interpreter and a launch is a Triton kernel launch (counted by the kernels' pre-run hooks) or a
torch op that computes (counted by a dispatch mode; views, allocations and the interpreter's own
argument copies are not launches). The per-layer count is the two-layer step's minus the
one-layer step's.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from data_plane.models import triton_attention, triton_fused  # noqa: E402
from data_plane.models.config import ModelConfig  # noqa: E402
from data_plane.models.llama import empty_model  # noqa: E402
from data_plane.models.paged_batch import HostBatch, paged_metadata  # noqa: E402
from data_plane.models.staging import HostStaging  # noqa: E402

MAX_LAUNCHES_PER_LAYER = 9  # norm, qkv, rope + kv, attention, o_proj, add + norm, gate_up,
# silu x up, down (issue 33: about 9-10; the torch ops took ~46)
BLOCK_SIZE = 16
CONTEXTS = [5, 17, 40, 3]  # one decode each

_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_"}


def _computes(func: Any, args: tuple[Any, ...], out: Any) -> bool:
    """Whether a torch op launches a kernel on a GPU: it writes (in place or into ``out=``) or
    returns storage none of its inputs has; an allocation, a view or a no-op cast does not.
    A copy of a storage onto itself (the interpreter's return of a launch's arguments) moves
    nothing."""
    if func.overloadpacket.__name__ in _ALLOCATIONS:
        return False
    inputs = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    if func._schema.is_mutable:
        return not (
            func.overloadpacket.__name__ == "copy_" and inputs[0].data_ptr() == inputs[1].data_ptr()
        )
    storages = {a.untyped_storage().data_ptr() for a in inputs}
    outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    return any(o.untyped_storage().data_ptr() not in storages for o in outputs)


class _ComputeOps(TorchDispatchMode):
    """Counts the torch ops that launch a kernel, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if _computes(func, args, out):
            self.ops[func.overloadpacket.__name__] += 1
        return out


@contextmanager
def _interpreted_launches(result: Counter[str]) -> Iterator[None]:
    """Counts into ``result`` every launch of our Triton kernels (their pre-run hooks) and
    every torch op that computes."""
    kernels = [
        *triton_fused.kernel_functions(),
        triton_attention._kernels().attention,
        triton_attention._kernels().write_kv,
    ]

    def hook(*args: Any, **kwargs: Any) -> None:
        result["triton"] += 1

    for kernel in kernels:
        kernel.add_pre_run_hook(hook)
    mode = _ComputeOps()
    try:
        with mode:
            yield
    finally:
        for kernel in kernels:
            kernel.pre_run_hooks.remove(hook)
        result.update(mode.ops)


@contextmanager
def _cuda_kernels(result: Counter[str]) -> Iterator[None]:
    """Counts into ``result`` the CUDA kernels the profiler records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield
        torch.cuda.synchronize()
    result.update(e.name for e in prof.events() if e.device_type.name == "CUDA")


def _model(num_layers: int) -> Any:
    config = ModelConfig(
        architecture="llama",
        vocab_size=512,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=num_layers,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=256,
        dtype=torch.bfloat16,
    )
    model = empty_model(config, DEVICE)
    for parameter in model.parameters():
        parameter.data.normal_(0, 0.02)
    return model


def _decode_step(model: Any, counting: Callable[[Counter[str]], Any]) -> Counter[str]:
    """The launches of one decode step of four sequences, by kernel or op name."""
    config = model.config
    rows_per_block = config.num_layers * 2 * BLOCK_SIZE
    tables = [[i * 4 + b for b in range(-(-n // BLOCK_SIZE))] for i, n in enumerate(CONTEXTS)]
    slots = [
        t[(n - 1) // BLOCK_SIZE] * rows_per_block + (n - 1) % BLOCK_SIZE
        for t, n in zip(tables, CONTEXTS, strict=True)
    ]
    n = len(CONTEXTS)
    batch = HostBatch(
        [1] * n, [c - 1 for c in CONTEXTS], slots, [1] * n, CONTEXTS, tables, n, list(range(n))
    )
    heads = (config.num_heads, config.num_kv_heads)
    ids, positions, meta, logits_index = paged_metadata(
        batch, BLOCK_SIZE, rows_per_block, heads, HostStaging(torch.device(DEVICE))
    )
    cache = torch.zeros(
        (16, config.num_layers, 2, BLOCK_SIZE, config.num_kv_heads, config.head_dim),
        dtype=torch.bfloat16,
        device=DEVICE,
    )
    model(ids, positions, cache, meta, logits_index)  # compiles the kernels (CUDA)
    launches: Counter[str] = Counter()
    with counting(launches):
        model(ids, positions, cache, meta, logits_index)
    return launches


@contextmanager
def _cuda_kernels() -> Iterator[Callable[[], int]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result: dict[str, int] = {}
        yield lambda: result.get("n", 0)
    torch.cuda.synchronize()
    result["n"] = sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def _per_layer(counting: Callable[[Counter[str]], Any]) -> tuple[int, int]:
    """(launches per decoder layer, launches outside the layers) of one decode step."""
    model = _model(2)
    two = _decode_step(model, counting).total()
    model.layers = model.layers[:1]
    one = _decode_step(model, counting).total()
    return two - one, 2 * one - two


@pytest.mark.skipif(DEVICE == "cuda", reason="counted by the profiler in the gpu test")
def test_a_decode_layer_is_nine_launches_interpreted() -> None:
    per_layer, outside = _per_layer(_interpreted_launches)
    assert per_layer <= MAX_LAUNCHES_PER_LAYER, f"{per_layer} launches per layer"
    assert outside <= 8, f"{outside} launches outside the layers"


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_a_decode_layer_is_nine_cuda_kernels() -> None:
    per_layer, _ = _per_layer(_cuda_kernels)
    # cuBLAS may split a matmul (split-K: a second kernel); never the ~46 of the torch ops
    assert per_layer <= MAX_LAUNCHES_PER_LAYER + 4, f"{per_layer} CUDA kernels per layer"
