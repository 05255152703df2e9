"""KV pool sizing with vLLM's flags: --gpu-memory-utilization, --max-model-len (validated
against the pool), --swap-space, --tensor-parallel-size."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from data_plane.engine.config import EngineConfig
from data_plane.engine.llm import build_engine
from data_plane.engine.sizing import (
    DEFAULT_CPU_KV_GIB,
    KVSizingError,
    device_total_bytes,
    validate_max_model_len,
    weights_bytes,
)
from data_plane.main import build_worker_engine, host_tier_gib
from data_plane.models import load_model
from data_plane.settings import WorkerSettings
from shared.policy import Knobs, make_plan


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    return load_model("tiny-random")


def test_explicit_max_model_len_must_fit_the_pool(tiny) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KVSizingError, match="does not fit in the KV pool"):
        build_engine(tiny, EngineConfig(num_hbm_blocks=8, block_size=16, max_model_len=200))
    engine = build_engine(tiny, EngineConfig(num_hbm_blocks=8, block_size=16, max_model_len=128))
    assert engine.max_model_len == 128


def test_max_model_len_beyond_the_model_is_an_error() -> None:
    with pytest.raises(KVSizingError, match="longer than the model"):
        validate_max_model_len(8192, 4096, num_blocks=10_000, block_size=16)
    with pytest.raises(KVSizingError, match=">= 1"):
        validate_max_model_len(0, 4096, num_blocks=10, block_size=16)


def test_the_models_length_is_capped_at_the_pool_with_a_warning() -> None:
    with capture_logs() as logs:
        assert validate_max_model_len(None, 4096, num_blocks=10, block_size=16) == 160
    assert logs[0]["event"] == "max_model_len_capped_by_kv_pool"
    assert logs[0]["log_level"] == "warning" and logs[0]["model_max_model_len"] == 4096
    assert validate_max_model_len(None, 4096, num_blocks=1000, block_size=16) == 4096


def test_default_cpu_pool_and_precedence(tiny) -> None:  # type: ignore[no-untyped-def]
    bytes_per_block = 16 * tiny.config.kv_bytes_per_token
    engine = build_engine(tiny, EngineConfig())
    assert engine.kv.hbm.num_blocks == int(DEFAULT_CPU_KV_GIB * 2**30) // bytes_per_block
    engine = build_engine(tiny, EngineConfig(hbm_kv_gib=0.01, gpu_memory_utilization=0.5))
    assert engine.kv.hbm.num_blocks == int(0.01 * 2**30) // bytes_per_block
    engine = build_engine(tiny, EngineConfig(num_hbm_blocks=7, hbm_kv_gib=0.01))
    assert engine.kv.hbm.num_blocks == 7


def test_gpu_memory_utilization_on_the_cpu_is_a_fraction_of_host_memory(
    tiny,  # type: ignore[no-untyped-def]
) -> None:
    total = device_total_bytes(tiny.model.embed_tokens.weight.device)
    utilization = (2**30 + weights_bytes(tiny.model)) / total  # about 1 GiB left for KV
    engine = build_engine(tiny, EngineConfig(gpu_memory_utilization=utilization))
    kv_bytes = engine.kv.hbm.num_blocks * 16 * tiny.config.kv_bytes_per_token
    assert 0.5 * 2**30 < kv_bytes < 2**30  # 1 GiB less a full batch's activations
    with pytest.raises(KVSizingError, match="leaves no room"):
        build_engine(tiny, EngineConfig(gpu_memory_utilization=1e-6))


def test_bad_utilization_values_are_rejected() -> None:
    for value in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=value)


def test_swap_space_is_the_host_tier() -> None:
    assert host_tier_gib(WorkerSettings(model="tiny-random", swap_space=4.0)) == 4.0
    assert host_tier_gib(WorkerSettings(model="tiny-random", dram_kv_gib=2.0)) == 2.0
    same = WorkerSettings(model="tiny-random", dram_kv_gib=2.0, swap_space=2.0)
    assert host_tier_gib(same) == 2.0
    with pytest.raises(ValueError, match="both size the host KV tier"):
        host_tier_gib(WorkerSettings(model="tiny-random", dram_kv_gib=2.0, swap_space=4.0))


def test_tensor_parallel_other_than_one_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="tensor-parallel-size 2"):
        settings = WorkerSettings(model="tiny-random", tensor_parallel_size=2)
        build_worker_engine(settings, planner=lambda snapshot: make_plan(snapshot, Knobs()))
