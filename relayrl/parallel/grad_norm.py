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
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    # summed on the gradients' device (one host sync at the end, not one per parameter)
    sq = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    for g in grads:
        n = torch.linalg.vector_norm(g, 2)
        sq += (n.full_tensor() if isinstance(n, DTensor) else n).double() ** 2
    total = float(sq.sqrt())
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
