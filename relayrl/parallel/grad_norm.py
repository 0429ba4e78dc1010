"""This module clips the gradient norm across any mix of plain tensors and DTensors (TP shards, FSDP
shards, replicated norms), a mix that torch's foreach clipping refuses.

    total = sqrt(sum over parameters of ||grad||^2)     each DTensor norm is reduced over its mesh
    grads *= min(1, max_norm / (total + 1e-6))

One small all-reduce per sharded parameter: fine at the sizes relayrl tests on; a fused version
(one all-reduce per mesh) is the next step for large models.

It imports torch only; it must never import another relayrl layer (models, single_controller, the
trainer, the engine, ...): they import it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def grad_norm(params: Iterable[torch.nn.Parameter], group=None) -> float:
    """sqrt(sum ||grad||^2) over params; with `group` also summed over its ranks (pipeline stages: each holds
    other parameters)."""
    grads = [p.grad for p in params if p.grad is not None]
    # summed on the gradients' device (one host sync at the end, not one per parameter)
    sq = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    for g in grads:
        n = torch.linalg.vector_norm(g, 2)
        sq += (n.full_tensor() if isinstance(n, DTensor) else n).double() ** 2
    if group is not None:
        dist.all_reduce(sq, group=group)
    return float(sq.sqrt())


@torch.no_grad()
def scale_grads(params: Iterable[torch.nn.Parameter], max_norm: float, total: float) -> None:
    """grads *= min(1, max_norm / (total + 1e-6))."""
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    params = list(params)
    total = grad_norm(params)
    scale_grads(params, max_norm, total)
    return total
