"""Block geometry: the block-first layout shared by every tier."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """One block holds ``block_size`` tokens of KV for all layers, contiguously:
    shape ``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        count = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return count * torch.tensor([], dtype=self.dtype).element_size()

    def blocks_in(self, gib: float) -> int:
        return int(gib * (1 << 30)) // self.block_bytes

    def allocate(
        self, num_blocks: int, device: str | torch.device, pin: bool = False
    ) -> torch.Tensor:
        return torch.zeros(
            (num_blocks, *self.block_shape), dtype=self.dtype, device=device, pin_memory=pin
        )
