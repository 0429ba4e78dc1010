"""This module holds the engine's tensor-parallel linear layers: the fused column-parallel ones (qkv_proj, gate_up_proj)
and the row-parallel one (o_proj, down_proj), each loading its rank's shard from the logical (Hugging Face) tensors
through `weight_loader(param, tensor, shard)` (relayrl.engine.model says how fused tensors are filled).

A row-parallel linear sums the ranks' partial outputs with an all-reduce; `reduce=False` leaves the partial sum to
its caller, which adds more partial terms first and reduces once (the MoE block: routed experts + shared expert).

It imports torch, the engine's own modules and relayrl.models only; like the whole engine, it must never import
the trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

import torch
from torch import nn

from relayrl.engine.lora import LoRATerm
from relayrl.engine.parallel_state import TPInfo, head_layout
from relayrl.models.config import ModelConfig
from relayrl.models.linear import linear


def _copy_weight(param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
    param.data.copy_(loaded)


class QKVParallelLinear(nn.Module):
    lora: LoRATerm | None = None  # adapters (relayrl.engine.lora), set by enable_lora

    def __init__(self, cfg: ModelConfig, tp: TPInfo):
        super().__init__()
        self.q_heads, self.kv_heads = head_layout(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        self.hd = cfg.head_dim
        rows = (len(self.q_heads) + 2 * len(self.kv_heads)) * self.hd
        self.weight = nn.Parameter(torch.empty(rows, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(rows)) if cfg.qkv_bias else None

    def rows_of(self, shard: str) -> tuple[slice, range]:
        """(destination rows in qkv_proj, logical heads of q_proj / k_proj / v_proj they hold)."""
        nq, nkv = len(self.q_heads) * self.hd, len(self.kv_heads) * self.hd
        if shard == "q":
            return slice(0, nq), self.q_heads
        if shard == "k":
            return slice(nq, nq + nkv), self.kv_heads
        return slice(nq + nkv, nq + 2 * nkv), self.kv_heads

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        dst, heads = self.rows_of(shard)
        src = loaded[heads.start * self.hd: heads.stop * self.hd]
        param.data[dst].copy_(src)

    def forward(self, x):
        y = linear(x, self.weight, self.bias)
        return self.lora.column(self, x, y) if self.lora is not None and self.lora.separate else y


class ColumnParallelLinear(nn.Module):
    """Output features split over ranks; `parts` logical tensors fused side by side (gate, up)."""

    lora: LoRATerm | None = None

    def __init__(self, in_features: int, out_per_part: int, parts: tuple[str, ...], tp: TPInfo, *, bias: bool):
        super().__init__()
        self.parts, self.tp = parts, tp
        self.local = out_per_part // tp.size
        self.weight = nn.Parameter(torch.empty(self.local * len(parts), in_features))
        self.bias = nn.Parameter(torch.empty(self.local * len(parts))) if bias else None

    def weight_loader(self, param, loaded, shard: str) -> None:
        i = self.parts.index(shard)
        src = loaded[self.tp.rank * self.local: (self.tp.rank + 1) * self.local]
        param.data[i * self.local: (i + 1) * self.local].copy_(src)

    def forward(self, x):
        y = linear(x, self.weight, self.bias)
        return self.lora.column(self, x, y) if self.lora is not None and self.lora.separate else y


class RowParallelLinear(nn.Module):
    """Input features split over ranks; partial outputs are summed with an all-reduce."""

    lora: LoRATerm | None = None

    def __init__(self, in_features: int, out_features: int, tp: TPInfo, *, bias: bool, col_ranges=None,
                 reduce: bool = True):
        super().__init__()
        self.tp, self.reduce = tp, reduce
        # which input columns this rank holds (o_proj: its Q heads' columns)
        self.cols = col_ranges or range(tp.rank * in_features // tp.size, (tp.rank + 1) * in_features // tp.size)
        self.weight = nn.Parameter(torch.empty(out_features, len(self.cols)))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def weight_loader(self, param, loaded, shard=None) -> None:
        if param is self.bias:  # added once after the all-reduce: every rank holds all of it
            param.data.copy_(loaded)
        else:
            param.data.copy_(loaded[:, self.cols.start:self.cols.stop])

    def forward(self, x):
        partial = linear(x, self.weight)
        if self.lora is not None and self.lora.separate:
            partial = self.lora.row(self, x, partial)
        if not self.reduce:  # the caller reduces (after adding its other partial terms); no bias then
            return partial
        out = self.tp.all_reduce(partial)
        return out + self.bias if self.bias is not None else out
