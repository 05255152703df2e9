"""DuplexKV transfer engines: move whole KV blocks between the HBM and DRAM pools."""

from __future__ import annotations

from data_plane.transfer.base import BlockCopy, TransferEngine, TransferHandle, merge_runs

__all__ = ["BlockCopy", "TransferEngine", "TransferHandle", "make_transfer_engine", "merge_runs"]


def make_transfer_engine(backend: str, hbm: object, dram: object) -> TransferEngine:
    """The backend named by config: ``cuda`` (cuda-python batched copies), ``cpu`` (the same
    semantics with both pools in host memory) or ``naive`` (vLLM-layout baseline)."""
    import torch

    assert isinstance(hbm, torch.Tensor) and isinstance(dram, torch.Tensor)
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
