"""The CPU kernels (``cpu_attention.c``: decode attention, RMSNorm, RoPE + KV write;
``cpu_matmul.c``: the int4 and int8 matmuls; ``cpu_dense.c``: the float32 matmul of few rows;
``cpu_decode_layer.c``: a whole decoder layer of decodes):
compiled once per host at first use into one library, called through ctypes.

The shared object is built with the system C compiler (``$CC``, else ``cc``) with
``-O3 -march=native`` into ``$XDG_CACHE_HOME/superinfer/kernels`` (``~/.cache`` by default),
named by a hash of the sources, the compiler flags and the CPU's feature flags, so a rebuild
happens only when one of them changes; concurrent builders each write a temporary file and
rename it into place. Where no compiler is found or the build fails, the library the
container image built for a baseline CPU (``PREBUILT``) serves if it is there; else
:func:`kernels` returns None once and for all (the reason is logged) and the model runs the
same steps as torch ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("cpu_attention.c", "cpu_matmul.c", "cpu_dense.c", "cpu_decode_layer.c")
)
HEADER = Path(__file__).with_name("cpu_exp.h")  # included by the sources
# Built for a baseline CPU by the container image (Dockerfile), which has no compiler at run
# time: used where no native build can be made.
PREBUILT = Path(__file__).with_name("cpu_attention_prebuilt.so")
CFLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
    "-fopenmp",
)
BUILD_TIMEOUT_S = 120.0

_DECODE_ARGTYPES: list[Any] = (
    [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    + [ctypes.c_int64] * 9
    + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int64]
)
_NORM_ARGTYPES: list[Any] = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float]
_ROPE_ARGTYPES: list[Any] = (
    [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
)
_MATMUL_ARGTYPES: list[Any] = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4


@dataclass(frozen=True, slots=True)
class Kernels:
    """The compiled functions (ctypes; they release the GIL while they run)."""

    paged_decode: Callable[..., int]
    rms_norm: Callable[..., None]
    rope_write_kv: Callable[..., None]
    int4_matmul: Callable[..., int]
    int4_matmul_available: Callable[[], int]
    int4_dequantize: Callable[..., None]
    int8_matmul: Callable[..., int]
    decode_layer: Callable[..., int]
    f32_matmul: Callable[..., int]
    f32_matmul_available: Callable[[], int]


_lock = threading.Lock()
_state: dict[str, Kernels | None] = {}


def kernels() -> Kernels | None:
    """The compiled kernels, or None where they cannot be built here (asked once)."""
    with _lock:
        if "kernels" not in _state:
            _state["kernels"] = _load()
        return _state["kernels"]


def set_enabled(enabled: bool) -> None:
    """Switch the kernels off (the torch ops serve) or back on: for A/B measurements
    (bench/cpu_kernels.py) and tests."""
    with _lock:
        if enabled:
            _state.pop("kernels", None)
        else:
            _state["kernels"] = None


def decode_kernel() -> Callable[..., int] | None:
    """The compiled ``paged_decode``, or None where it cannot be built here."""
    found = kernels()
    return None if found is None else found.paged_decode


def _load() -> Kernels | None:
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as exc:
        if not PREBUILT.exists():
            log.warning("cpu_kernels_unavailable", reason=str(exc)[:500])
            return None
        log.info("cpu_kernels_prebuilt", path=str(PREBUILT), reason=str(exc)[:500])
        library = ctypes.CDLL(str(PREBUILT))
    decode, norm, rope = library.paged_decode, library.rms_norm, library.rope_write_kv
    decode.argtypes, decode.restype = _DECODE_ARGTYPES, ctypes.c_int
    norm.argtypes, norm.restype = _NORM_ARGTYPES, None
    rope.argtypes, rope.restype = _ROPE_ARGTYPES, None
    int4, int4_available = library.int4_matmul, library.int4_matmul_available
    int4.argtypes, int4.restype = _MATMUL_ARGTYPES, ctypes.c_int
    int4_available.argtypes, int4_available.restype = [], ctypes.c_int
    int8 = library.int8_matmul
    int8.argtypes, int8.restype = _MATMUL_ARGTYPES, ctypes.c_int
    dequantize = library.int4_dequantize
    dequantize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    dequantize.restype = None
    layer = library.decode_layer
    layer.argtypes, layer.restype = [ctypes.c_void_p], ctypes.c_int
    dense, dense_available = library.f32_matmul, library.f32_matmul_available
    dense.argtypes, dense.restype = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4, ctypes.c_int
    dense_available.argtypes, dense_available.restype = [], ctypes.c_int
    return Kernels(
        decode, norm, rope, int4, int4_available, dequantize, int8, layer, dense, dense_available
    )


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or $CC) on PATH")
    source = b"".join(path.read_bytes() for path in (*SOURCES, HEADER))
    key = hashlib.sha256(source + " ".join((compiler, *CFLAGS, _cpu_flags())).encode())
    target = _cache_dir() / f"cpu_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, *CFLAGS, *map(str, SOURCES), "-o", temporary, "-lm"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise OSError(f"{' '.join(command)} failed: {done.stderr.strip()}")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    log.info("cpu_attention_kernel_built", path=str(target))
    return target


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "superinfer" / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds for them), or the machine's name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def paged_decode(
    q: torch.Tensor,
    cache_rows: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    geometry: tuple[int, int, int],
    window: int | None,
    scale: float,
) -> torch.Tensor | None:
    """Decode attention ``[n, heads, head_dim]`` read in place from ``cache_rows`` (float32 or
    bfloat16, contiguous), or None where the kernel is unavailable. ``geometry`` is
    (block_size, rows_per_block, layer_offset); ``tables`` [n, width] and ``lens`` [n] int64."""
    fn = decode_kernel()
    if fn is None or not (plain_index(tables, lens) and cache_rows.is_contiguous()):
        return None
    if cache_rows.dtype not in (torch.float32, torch.bfloat16):  # it reads 4 or 2 bytes
        raise ValueError(f"paged_decode: the cache is {cache_rows.dtype}, not float32/bfloat16")
    n, num_heads, head_dim = q.shape
    if tables.shape[0] != n or lens.shape[0] != n:
        raise ValueError("paged_decode: one block table and one length per query row")
    query = q.float().contiguous()
    out = torch.empty_like(query)
    block_size, rows_per_block, layer_offset = geometry
    status = fn(
        query.data_ptr(),
        cache_rows.data_ptr(),
        int(cache_rows.dtype == torch.bfloat16),
        tables.data_ptr(),
        lens.data_ptr(),
        n,
        tables.shape[1],
        num_heads,
        cache_rows.shape[1],
        head_dim,
        block_size,
        rows_per_block,
        layer_offset,
        window or 0,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("paged_decode: no memory for its scores")
    return out.to(q.dtype)


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """RMSNorm of float32 ``x`` [..., dim] by ``weight``; with ``residual``, of ``residual + x``,
    which is stored into ``residual`` (the residual stream, updated in place). None where the
    kernels are unavailable or the tensors are not contiguous float32 on the CPU."""
    found = kernels()
    if (
        found is None
        or not plain_f32(x, weight)
        or weight.shape != x.shape[-1:]
        or (residual is not None and not (plain_f32(residual) and residual.shape == x.shape))
    ):
        return None
    out = torch.empty_like(x)
    rows = x.numel() // x.shape[-1]
    if residual is None:
        found.rms_norm(
            x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), rows, x.shape[-1], eps
        )
    else:
        found.rms_norm(
            residual.data_ptr(),
            x.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            x.shape[-1],
            eps,
        )
    return out


def plain_f32(*tensors: torch.Tensor) -> bool:
    return all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors
    )


def rope_write_kv(
    qkv: torch.Tensor,
    heads: tuple[int, int, int],
    rope: tuple[torch.Tensor, torch.Tensor],
    cache_rows: torch.Tensor,
    slot_rows: torch.Tensor,
    placement: tuple[int, int],
) -> bool:
    """RoPE of ``qkv``'s q and k heads in place and its k and v stored in the cache (float32,
    CPU); False (nothing done) where the kernels are unavailable or the tensors do not fit.
    ``heads`` is (q heads, kv heads, head_dim), ``rope`` the step's (cos, sin) [n, 1, d/2],
    ``placement`` (layer_offset, block_size)."""
    found = kernels()
    cos, sin = rope
    if found is None or not (plain_f32(qkv, cache_rows, cos, sin) and plain_index(slot_rows)):
        return False
    num_q, num_kv, head_dim = heads
    layer_offset, block_size = placement
    found.rope_write_kv(
        qkv.data_ptr(),
        qkv.shape[0],
        qkv.shape[1],
        num_q,
        num_kv,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        cache_rows.data_ptr(),
        slot_rows.data_ptr(),
        layer_offset,
        block_size,
    )
    return True


def plain_index(*tensors: torch.Tensor) -> bool:
    """int64, contiguous, on the CPU: what the kernels read as ``int64_t *``."""
    return all(
        t.dtype == torch.int64 and t.device.type == "cpu" and t.is_contiguous() for t in tensors
    )


def int4_available() -> bool:
    """Whether :func:`int4_matmul` computes here (the library built with AVX512-VNNI)."""
    found = kernels()
    return found is not None and bool(found.int4_matmul_available())


def int4_matmul(
    x: torch.Tensor, codes: torch.Tensor, scale_bits: torch.Tensor
) -> torch.Tensor | None:
    """``x`` [m, k] float32 @ W.T, W [n, k] as 4-bit ``codes`` [n / 16, k / 32, 4, 16, 4] and
    ``scale_bits`` [n / 16, k / 32, 2, 16] (``int4_blocks``' layout): float32 [m, n]. None
    where the kernel is unavailable here or ``x`` is not a float32 matrix on the CPU."""
    n, k = codes.shape[0] * 16, x.shape[-1]
    shapes = ((n // 16, k // 32, 4, 16, 4), (n // 16, k // 32, 2, 16))
    return _quantized_matmul("int4_matmul", x, codes, scale_bits, shapes)


def int8_matmul(
    x: torch.Tensor, codes: torch.Tensor, scale_bits: torch.Tensor
) -> torch.Tensor | None:
    """``x`` [m, k] float32 @ W.T, W [n, k] as int8 ``codes`` (plus 128) [n / 16, k / 32, 8, 16,
    4] and one bfloat16 scale per row, ``scale_bits`` [n] (``int8_blocks``' layout): float32 [m,
    n]. None where the kernel is unavailable here or ``x`` is not a float32 matrix on the CPU."""
    n, k = codes.shape[0] * 16, x.shape[-1]
    return _quantized_matmul(
        "int8_matmul", x, codes, scale_bits, ((n // 16, k // 32, 8, 16, 4), (n,))
    )


def _quantized_matmul(
    name: str,
    x: torch.Tensor,
    codes: torch.Tensor,
    scale_bits: torch.Tensor,
    shapes: tuple[tuple[int, ...], tuple[int, ...]],
) -> torch.Tensor | None:
    found = kernels()
    if found is None or not found.int4_matmul_available():
        return None
    if x.dim() != 2 or not plain_f32(x):
        return None
    m, k = x.shape
    n = codes.shape[0] * 16
    if (
        (codes.shape, scale_bits.shape) != shapes
        or k % 32
        or not (codes.is_contiguous() and scale_bits.is_contiguous())
    ):
        raise ValueError(f"{name}: weights {tuple(codes.shape)} do not match x {(m, k)}")
    out = torch.empty(m, n, dtype=torch.float32)
    kernel = found.int4_matmul if name == "int4_matmul" else found.int8_matmul
    pointers = (x.data_ptr(), codes.data_ptr(), scale_bits.data_ptr(), out.data_ptr())
    status = kernel(*pointers, m, n, k, torch.get_num_threads())
    if status == -2:
        raise MemoryError(f"{name}: no memory for the quantized activations")
    return out if status == 0 else None


def int4_dequantize(codes: torch.Tensor, scale_bits: torch.Tensor) -> torch.Tensor | None:
    """The weight [n, k] in bfloat16 from ``int4_blocks``' layout (see :func:`int4_matmul`),
    or None where the kernels are unavailable."""
    found = kernels()
    if found is None:
        return None
    if not (codes.is_contiguous() and scale_bits.is_contiguous()):
        raise ValueError("int4_dequantize: the codes and scales must be contiguous")
    num_blocks, groups = codes.shape[:2]
    n, k = num_blocks * 16, groups * 32
    out = torch.empty(n, k, dtype=torch.bfloat16)
    found.int4_dequantize(
        codes.data_ptr(), scale_bits.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads()
    )
    return out


def f32_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x`` [m, k] @ ``weight``.T (``weight`` [n, k]), both float32 contiguous on the CPU:
    float32 [m, n]. None where the kernel does not compute here (no AVX-512, kernels off) or
    the operands are not such matrices."""
    found = kernels()
    if found is None or not found.f32_matmul_available():
        return None
    if x.dim() != 2 or weight.dim() != 2 or not plain_f32(x, weight):
        return None
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"f32_matmul: weight {tuple(weight.shape)} does not match x {(m, k)}")
    out = torch.empty(m, n, dtype=torch.float32)
    status = found.f32_matmul(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), m, n, k, torch.get_num_threads()
    )
    return out if status == 0 else None
