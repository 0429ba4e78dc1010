"""This module gives the engine's fused projections LoRA adapters, kept apart or merged into the weights.

A weight sync with LoRA sends the adapters only (the frozen base once). Each targeted engine module
then holds, on its rank (the layout relayrl.sync.adapters plans into; A and B of logical part j of
rank r, the update being  W + s * B @ A,  s = alpha / r):

    column-parallel, fused (qkv_proj: q | k | v; gate_up_proj: gate | up)
        lora_A [P*r, in]      part j's A in rows [j*r, (j+1)*r)            (whole on every rank)
        lora_B [rows, r]      part j's B rows of this rank's shard, stacked in part order
    row-parallel (o_proj, down_proj)
        lora_A [r, cols]      A's columns of this rank's input shard
        lora_B [out, r]       whole

Two modes (the run's `sync.lora`):

    separate   forward adds the low-rank term:  fused y[rows of part j] += s * (x A_j^T) B_j^T ;
               row-parallel: partial += s * (x_local A_local^T) B^T before the all-reduce (the sum over
               ranks of x_local A_local^T is x A^T, so the all-reduce sums the term too). Cost per token:
               2 * r * (in + out) multiply-adds per module, none when the adapters are absent.
    merge      forward is the plain fused matmul. The module keeps `lora_base`, a copy of its base
               weight, which is what the sync writes the base into; merge_lora() then writes
               W = W_base + s * B @ A (in float32, then the engine's dtype) for this rank's rows and
               columns only. Memory: a second copy of every targeted module's base weights on each
               rank — with all seven projections targeted, every decoder matrix (86% of Qwen2.5-7B:
               +12.2 GiB in bf16 at engine TP 1, divided by the TP degree) — the price of a forward
               as fast as the base model's. `separate` holds no copy (the adapters only, ~0.5% of it).

It imports torch and the engine's own modules only; like the whole engine, it must never import the
trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("separate", "merge")


@dataclass(frozen=True)
class Span:
    """Part j of a fused module: its output rows in the fused weight, its rows of lora_A and of lora_B."""

    out: slice
    a: slice
    b: slice


@dataclass
class LoRATerm:
    """One engine module's adapters (the parameters themselves are the module's lora_A / lora_B)."""

    scaling: float
    separate: bool
    spans: tuple[Span, ...] | None  # fused, column-parallel; None: row-parallel (one block, whole output)

    def column(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + the low-rank term of each targeted part, into that part's output columns."""
        u = F.linear(x, module.lora_A)
        for s in self.spans:
            y[..., s.out] += self.scaling * F.linear(u[..., s.a], module.lora_B[s.b])
        return y

    def row(self, module: nn.Module, x: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum + its share of the low-rank term (the all-reduce adds the rest)."""
        return partial + self.scaling * F.linear(F.linear(x, module.lora_A), module.lora_B)

    @torch.no_grad()
    def merge(self, module: nn.Module) -> None:
        base, w = module.lora_base, module.weight.data
        a, b = module.lora_A.float(), module.lora_B.float()
        if self.spans is None:
            w.copy_(base.float() + self.scaling * (b @ a))
            return
        w.copy_(base)
        for s in self.spans:
            w[s.out] = (base[s.out].float() + self.scaling * (b[s.b] @ a[s.a])).to(w.dtype)


def _attach(module: nn.Module, a_shape, b_shape, term: LoRATerm) -> None:
    w = module.weight
    module.lora_A = nn.Parameter(torch.zeros(a_shape, dtype=w.dtype, device=w.device), requires_grad=False)
    module.lora_B = nn.Parameter(torch.zeros(b_shape, dtype=w.dtype, device=w.device), requires_grad=False)
    module.lora = term
    if not term.separate:
        module.lora_base = w.detach().clone()


def enable_lora(model: nn.Module, rank: int, scaling: float, targets: tuple[str, ...],
                mode: Literal["separate", "merge"]) -> None:
    """Give every targeted module of an EngineModel zero adapters of rank `rank` (a sync fills them)."""
    if mode not in MODES:
        raise ValueError(f"LoRA mode must be one of {', '.join(MODES)}, got {mode!r}")
    if any(getattr(m, "lora", None) is not None for m in model.modules()):
        raise RuntimeError("this engine model already has LoRA adapters")
    separate = mode == "separate"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj
        fused = [(qkv, [(p, qkv.rows_of(p.removesuffix("_proj"))[0]) for p in ("q_proj", "k_proj", "v_proj")])]
        gu, n = mlp.gate_up_proj, mlp.gate_up_proj.local
        fused.append((gu, [(p, slice(i * n, (i + 1) * n)) for i, p in enumerate(("gate_proj", "up_proj"))]))
        for module, parts in fused:
            spans, b_at = [], 0
            for out in (o for p, o in parts if p in targets):
                rows = out.stop - out.start
                spans.append(Span(out, slice(len(spans) * rank, (len(spans) + 1) * rank), slice(b_at, b_at + rows)))
                b_at += rows
            if spans:
                _attach(module, (len(spans) * rank, module.weight.shape[1]), (b_at, rank),
                        LoRATerm(scaling, separate, tuple(spans)))
        for name, module in (("o_proj", attn.o_proj), ("down_proj", mlp.down_proj)):
            if name in targets:
                out_f, cols = module.weight.shape
                _attach(module, (rank, cols), (out_f, rank), LoRATerm(scaling, separate, None))


def lora_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, "lora", None) is not None]


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """merge mode: every targeted module's weight becomes base + s * B @ A (a no-op when separate)."""
    for m in lora_modules(model):
        if not m.lora.separate:
            m.lora.merge(m)


def sync_params(model: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a weight sync writes into, by engine parameter name: in merge mode a targeted module's
    weight is its base copy (merge_lora derives the weight the forward uses from it)."""
    out = dict(params)
    for name, m in model.named_modules():
        if getattr(m, "lora", None) is not None and not m.lora.separate:
            out[f"{name}.weight"] = m.lora_base
    return out


def free_bases(model: nn.Module) -> None:
    """Deep sleep: the base copies go with the weights (the next sync sends the base again)."""
    for m in lora_modules(model):
        if not m.lora.separate:
            m.lora_base = torch.empty(0, dtype=m.lora_base.dtype, device=m.lora_base.device)


def restore_bases(model: nn.Module) -> None:
    for m in lora_modules(model):
        if not m.lora.separate:
            m.lora_base = torch.zeros_like(m.weight)
