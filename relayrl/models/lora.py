"""This module adds LoRA adapters to a plain CausalLM: each target nn.Linear becomes a LoRALinear that keeps
its frozen base weight and learns a low-rank update beside it.

    y = x W^T + b + s * dropout(x) A^T B^T        A [r, in] (lora_A), B [out, r] (lora_B), s = alpha / r

Names (what checkpoints, the weight sync and the PEFT export rely on): a LoRALinear IS an nn.Linear, so
its base parameters keep their Hugging Face names (`model.layers.0.self_attn.q_proj.weight`), and the
adapters sit beside them as `model.layers.0.self_attn.q_proj.lora_A` / `.lora_B`. Initialisation is
peft's: A kaiming-uniform(a=sqrt(5)) from one seeded generator (modules in named_modules order), B zeros,
so a fresh adapter leaves the model's output unchanged.

    merged_weight(m) = W + s * B @ A            what the engine (and a merged export) runs

It imports torch and the models' own config only; it must never import another relayrl layer: models hold
no parallelism (tensor / data parallelism is applied to the LoRA model afterwards, and shards the adapters
by the style of their base linear).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from relayrl.models.linear import Linear, linear
from relayrl.models.lora_config import LORA_TARGETS, LoRAConfig

__all__ = [
    "LORA_TARGETS", "LoRAConfig", "LoRALinear", "apply_lora", "apply_lora_config", "is_lora_param", "lora_modules",
    "lora_state", "merge_lora_state_dict", "merged_state", "merged_weight", "set_lora_enabled",
]


class _DownProjection(torch.autograd.Function):
    """x A^T computed in A's dtype (fp32 adapters over a bf16 base), keeping x itself for backward.

    F.linear(x.to(A.dtype), A) would keep the cast: a full-size fp32 copy of x per target (q, k and v read the
    same x: 6x its bf16 bytes), beside the x every target shares. Here backward casts x again, transiently.
    The numbers are those of the cast-then-linear (fp32 products, A's gradient in fp32): computing in x's
    dtype instead would round each rank's partial gradient of A to bf16, and data-parallel ranks would no
    longer sum to the one-process gradient at fp32 precision."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, a)
        return F.linear(x.to(a.dtype), a)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, a = ctx.saved_tensors
        gx = (g @ a).to(x.dtype) if ctx.needs_input_grad[0] else None
        ga = None
        if ctx.needs_input_grad[1]:  # dL/dA = g^T x over every token, as linear's backward computes it
            ga = (x.to(a.dtype).flatten(0, -2).T @ g.flatten(0, -2)).T
        return gx, ga


class LoRALinear(nn.Linear):
    """An nn.Linear (frozen W, b) plus a trainable low-rank update (lora_A, lora_B) scaled by alpha / r."""

    def __init__(self, in_features: int, out_features: int, *, rank: int, alpha: float, dropout: float = 0.0,
                 bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Parameter(torch.zeros(rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=dtype))
        self.lora_enabled = True  # False: the base linear alone (the reference model = base, adapters off)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, rank: int, alpha: float, dropout: float = 0.0,
                    adapter_dtype: torch.dtype | None = None) -> LoRALinear:
        """Wrap `linear`'s own weight / bias Parameters (no copy); adapters in adapter_dtype (default the
        base's). Call reset_lora_parameters to initialise them."""
        dtype = adapter_dtype or linear.weight.dtype
        with torch.device("meta"):  # the base weight is taken over, never allocated twice
            m = cls(linear.in_features, linear.out_features, rank=rank, alpha=alpha, dropout=dropout,
                    bias=linear.bias is not None)
        m.weight, m.bias = linear.weight, linear.bias
        dev = linear.weight.device
        m.lora_A = nn.Parameter(torch.zeros(rank, linear.in_features, device=dev, dtype=dtype))
        m.lora_B = nn.Parameter(torch.zeros(linear.out_features, rank, device=dev, dtype=dtype))
        return m

    @torch.no_grad()
    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """peft's init: A ~ kaiming_uniform(a=sqrt(5)) (bound 1/sqrt(in)), B = 0."""
        a = torch.empty(self.lora_A.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A.copy_(a)
        self.lora_B.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return y
        h = self.lora_dropout(x)
        if h.dtype == self.lora_A.dtype or torch.is_autocast_enabled(h.device.type):
            xa = F.linear(h, self.lora_A)  # autocast, when on, picks the matmuls' dtype itself
        else:  # fp32 adapters over a bf16 base: the adapters' math in fp32, without keeping an fp32 copy of x
            xa = _DownProjection.apply(h, self.lora_A)
        return y + (F.linear(xa, self.lora_B) * self.scaling).to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's LoRALinear modules by their (Hugging Face) module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def is_lora_param(name: str) -> bool:
    """True for an adapter parameter's name (`...q_proj.lora_A` / `...q_proj.lora_B`)."""
    return name.endswith((".lora_A", ".lora_B"))


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
               targets: list[str] | tuple[str, ...] = LORA_TARGETS, seed: int = 0,
               adapter_dtype: torch.dtype | None = torch.float32) -> nn.Module:
    """Replace every nn.Linear whose last name is in `targets` (q_proj, ..., down_proj) by a LoRALinear, in
    place; freeze every other parameter. Adapters are fp32 by default (whatever the base's dtype).
    Returns the model. Raises ValueError when no module matches (a wrong target list would train nothing)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    targets = tuple(targets)
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    found = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if child_name in targets and type(child) in (nn.Linear, Linear):
                lora = LoRALinear.from_linear(child, rank=rank, alpha=alpha, dropout=dropout,
                                              adapter_dtype=adapter_dtype)
                lora.reset_lora_parameters(g)
                setattr(parent, child_name, lora)
                found += 1
    if not found:
        raise ValueError(f"no linear module named any of {list(targets)} in the model")
    return model


def apply_lora_config(model: nn.Module, cfg: LoRAConfig, seed: int = 0) -> nn.Module:
    """apply_lora with a `trainer.lora` section; the frozen base is cast to cfg.base_dtype first."""
    model.to(getattr(torch, cfg.base_dtype))
    return apply_lora(model, cfg.rank, cfg.alpha, cfg.dropout, cfg.target_modules, seed=seed)


def set_lora_enabled(model: nn.Module, enabled: bool) -> None:
    """Switch every adapter on or off (off: the base model's output, e.g. for reference logprobs)."""
    for m in lora_modules(model).values():
        m.lora_enabled = enabled


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: tensor} of the adapters only (`...q_proj.lora_A`, `...q_proj.lora_B`), as held (DTensors
    stay DTensors)."""
    return {n: p for n, p in model.named_parameters() if is_lora_param(n)}


@torch.no_grad()
def merged_weight(module: LoRALinear) -> torch.Tensor:
    """W + s * B @ A, in the base weight's dtype (computed in fp32). Works on full tensors; for sharded
    modules gather first (or merge per shard: a colwise shard's rows need its rows of B and all of A)."""
    w = module.weight
    delta = (module.lora_B.float() @ module.lora_A.float()) * module.scaling
    return (w.float() + delta).to(w.dtype)


@torch.no_grad()
def merge_lora_state_dict(sd: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A full (gathered) LoRA state dict -> the plain model's: each `<m>.weight` with a `<m>.lora_A` /
    `<m>.lora_B` beside it becomes W + scaling * B @ A (fp32 math, W's dtype), adapters dropped."""
    out = {n: t for n, t in sd.items() if not is_lora_param(n)}
    for n in sd:
        if n.endswith(".lora_A"):
            mod = n.removesuffix(".lora_A")
            w = sd[f"{mod}.weight"]
            delta = (sd[f"{mod}.lora_B"].float() @ sd[n].float()) * scaling
            out[f"{mod}.weight"] = (w.float() + delta).to(w.dtype)
    return out


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the equivalent plain model: each LoRA target's weight merged, adapters dropped."""
    mods = lora_modules(model)
    out = {}
    for n, t in model.state_dict().items():
        if is_lora_param(n):
            continue
        mod = n.removesuffix(".weight")
        out[n] = merged_weight(mods[mod]) if n.endswith(".weight") and mod in mods else t
    return out
