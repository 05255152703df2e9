"""An independent reference for stories260K: llama2.c's ``run.c`` forward pass written out in
torch from the checkpoint file itself (the kit's README gives its layout), sharing no code
with our loader or model: RoPE on adjacent pairs, grouped-query attention, SwiGLU, the
classifier tied to the embedding. ``logprobs(tokens)``: log_softmax at every position."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch


class StoriesReference:
    def __init__(self, path: Path) -> None:
        raw = path.read_bytes()
        dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack("<7i", raw[:28])
        self.dim, self.heads, self.kv_heads, self.layers = dim, heads, kv_heads, layers
        self.head = dim // heads
        values = torch.from_numpy(np.frombuffer(raw, dtype="<f4", offset=28).copy())
        kv_dim = kv_heads * self.head
        shapes = {
            "emb": (abs(vocab), dim),
            "att_norm": (layers, dim),
            "wq": (layers, dim, dim),
            "wk": (layers, kv_dim, dim),
            "wv": (layers, kv_dim, dim),
            "wo": (layers, dim, dim),
            "ffn_norm": (layers, dim),
            "w1": (layers, hidden, dim),
            "w2": (layers, dim, hidden),
            "w3": (layers, hidden, dim),
            "norm": (dim,),
        }
        self.w: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape in shapes.items():
            size = int(np.prod(shape))
            self.w[name] = values[offset : offset + size].view(shape)
            offset += size
        self.max_len = seq_len

    @staticmethod
    def _rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate each (2i, 2i+1) pair of every head by position x frequency (run.c)."""
        num, width = x.shape
        pos = torch.arange(num, dtype=torch.float64).unsqueeze(1)
        index = torch.arange(0, width, 2) % self.head
        angle = pos * (1.0 / 10000.0 ** (index.double() / self.head))
        cos, sin = angle.cos().float(), angle.sin().float()
        even, odd = x[:, 0::2], x[:, 1::2]
        out = torch.empty_like(x)
        out[:, 0::2] = even * cos - odd * sin
        out[:, 1::2] = even * sin + odd * cos
        return out

    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        w, num = self.w, len(tokens)
        x = w["emb"][torch.tensor(tokens)]
        mask = torch.full((num, num), float("-inf")).triu(1)
        group = self.heads // self.kv_heads
        for layer in range(self.layers):
            xb = self._rmsnorm(x, w["att_norm"][layer])
            q = self._rope(xb @ w["wq"][layer].T).view(num, self.heads, self.head)
            k = self._rope(xb @ w["wk"][layer].T).view(num, self.kv_heads, self.head)
            v = (xb @ w["wv"][layer].T).view(num, self.kv_heads, self.head)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / self.head**0.5 + mask
            attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(num, -1)
            x = x + attended @ w["wo"][layer].T
            xb = self._rmsnorm(x, w["ffn_norm"][layer])
            gate = torch.nn.functional.silu(xb @ w["w1"][layer].T)
            x = x + (gate * (xb @ w["w3"][layer].T)) @ w["w2"][layer].T
        logits = self._rmsnorm(x, w["norm"]) @ w["emb"].T
        return torch.log_softmax(logits.double(), dim=-1)
