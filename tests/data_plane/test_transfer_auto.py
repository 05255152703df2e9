"""The DRAM tier's transfer backend defaults to ``auto``: the cuda backend (copies on their own
streams, under the compute) where the HBM pool is on a CUDA device and cuda-python imports,
the synchronous cpu backend otherwise (issue 33 item 9: the default was cpu even on CUDA)."""

from __future__ import annotations

import pytest
import torch

from data_plane.engine.config import EngineConfig
from data_plane.settings import WorkerSettings
from data_plane.transfer import make_transfer_engine
from data_plane.transfer.cpu import CpuTransferEngine


def test_auto_is_the_default_and_cpu_on_host_pools() -> None:
    assert EngineConfig().transfer_backend == "auto"
    assert WorkerSettings().transfer_backend == "auto"
    hbm, dram = torch.zeros(4, 2, 8), torch.zeros(8, 2, 8)
    assert isinstance(make_transfer_engine("auto", hbm, dram), CpuTransferEngine)
    with pytest.raises(ValueError, match="transfer_backend"):
        EngineConfig(transfer_backend="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_is_cuda_on_a_cuda_pool() -> None:
    pytest.importorskip("cuda.bindings")
    from data_plane.transfer.cuda import CudaTransferEngine

    hbm = torch.zeros(4, 2, 8, device="cuda")
    dram = torch.zeros(8, 2, 8).pin_memory()
    assert isinstance(make_transfer_engine("auto", hbm, dram), CudaTransferEngine)
