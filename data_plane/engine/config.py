"""Engine settings (mechanism sizes; the policy and its knobs come separately)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    num_hbm_blocks: int | None = None  # wins over hbm_kv_gib when set
    hbm_kv_gib: float | None = None  # wins over gpu_memory_utilization when set
    gpu_memory_utilization: float | None = None  # None: the device's default (sizing.py)
    num_dram_blocks: int | None = None  # wins over dram_kv_gib when set
    dram_kv_gib: float = 0.0
    pin_chunk_gib: float = 1.0  # host pool pinned this much at a time, in the background
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # the most tokens one prefill chunk takes (0: none)
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's, capped by the pool (sizing.py)
    transfer_backend: str = "auto"  # auto | cpu | cuda | naive (data_plane.transfer)
    eager_sync: bool = True
    device: str = "cpu"
    prefix_caching: bool = False  # HBM's prefix cache (data_plane/kv/prefix_cache.py)
    dram_prefix_caching: bool = True  # with it: the DRAM tier's synced copies as a second level

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.long_prefill_token_threshold < 0:
            message = "long_prefill_token_threshold must be >= 0, got "
            raise ValueError(message + str(self.long_prefill_token_threshold))
        utilization = self.gpu_memory_utilization
        if utilization is not None and not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        if self.hbm_kv_gib is not None and not self.hbm_kv_gib > 0:
            raise ValueError(f"hbm_kv_gib must be > 0, got {self.hbm_kv_gib}")
        if self.transfer_backend not in ("auto", "cpu", "cuda", "naive"):
            raise ValueError(
                f"transfer_backend must be auto, cpu, cuda or naive, got {self.transfer_backend!r}"
            )
