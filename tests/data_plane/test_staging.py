from __future__ import annotations

import numpy as np
import pytest
import torch

from data_plane.models.staging import HostStaging, padded_table_array


def test_padded_table_array_pads_with_block_zero() -> None:
    tables = [[3, 1], [], [7, 8, 9]]
    expected = [t + [0] * (4 - len(t)) for t in tables]
    assert padded_table_array(tables, 4).tolist() == expected
    assert padded_table_array([], 4).shape == (0, 4)
    with pytest.raises(ValueError, match="wider than 2"):
        padded_table_array(tables, 2)


def test_stage_returns_each_array_with_its_shape() -> None:
    staging = HostStaging(torch.device("cpu"), capacity=8)
    first = np.arange(5, dtype=np.int64)
    table = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    got = staging.stage([first, empty, table])  # 11 elements: the buffers grow
    assert got[0].tolist() == first.tolist()
    assert got[1].numel() == 0
    assert got[2].shape == (2, 3) and got[2].tolist() == table.tolist()
    again = staging.stage([np.array([9, 8], dtype=np.int64)])
    assert again[0].tolist() == [9, 8]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staged_values_survive_a_busy_stream() -> None:
    """Steps staged back to back while the stream is still busy: each step's kernels read that
    step's values (the event keeps the pinned buffer until its copy has run)."""
    staging = HostStaging(torch.device("cuda"), capacity=64)
    sums = []
    for step in range(20):
        torch.cuda._sleep(1_000_000)  # keep the stream busy so copies queue behind it
        (values,) = staging.stage([np.full(64, step, dtype=np.int64)])
        sums.append(values.sum())
    assert [int(s) for s in sums] == [64 * step for step in range(20)]
