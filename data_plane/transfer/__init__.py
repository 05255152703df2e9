"""DuplexKV transfer engines: move whole KV blocks between the HBM and DRAM pools."""

from __future__ import annotations

from data_plane.transfer.base import BlockCopy, TransferEngine, TransferHandle, merge_runs

__all__ = ["BlockCopy", "TransferEngine", "TransferHandle", "make_transfer_engine", "merge_runs"]


def make_transfer_engine(backend: str, hbm: object, dram: object) -> TransferEngine:
    """The backend named by config: ``cuda`` (cuda-python batched copies, on their own streams
    under the compute), ``cpu`` (the same semantics with synchronous copies: both pools in host
    memory, or a CUDA pool without cuda-python), ``naive`` (vLLM-layout baseline) or ``auto``
    (the default): ``cuda`` when the HBM pool is on a CUDA device and cuda-python imports, else
    ``cpu``."""
    import torch

    assert isinstance(hbm, torch.Tensor) and isinstance(dram, torch.Tensor)
    if backend == "auto":
        backend = "cuda" if hbm.is_cuda and _cuda_python() else "cpu"
    if backend == "cpu":
        from data_plane.transfer.cpu import CpuTransferEngine

        return CpuTransferEngine(hbm, dram)
    if backend == "naive":
        from data_plane.transfer.naive import NaiveTransferEngine

        return NaiveTransferEngine(hbm, dram)
    if backend == "cuda":
        from data_plane.transfer.cuda import CudaTransferEngine

        return CudaTransferEngine(hbm, dram)
    raise ValueError(f"unknown transfer backend {backend!r} (cuda, cpu, naive)")


def _cuda_python() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:  # no ``cuda`` package at all
        return False
