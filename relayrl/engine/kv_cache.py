"""A contiguous per-layer KV cache for batched decoding (the first engine's; the paged cache of the
next engine replaces it).

    k[layer]: [B, kv_heads, max_len, head_dim]   slots [0, past_len) are filled

The model calls `update(layer, k, v)` once per layer per forward; the engine calls `advance(q)`
after the forward, so every layer of one forward writes at the same offset.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device="cpu"):
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._past = 0

    @property
    def past_len(self) -> int:
        return self._past

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        end = self._past + k.shape[2]
        self.k[layer][:, :, self._past:end] = k
        self.v[layer][:, :, self._past:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, q_len: int) -> None:
        self._past += q_len

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished sequences so that decode steps only compute live rows."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]
