"""This module builds AdamW and the learning-rate schedule.

    lr(step) = lr * (step + 1) / warmup                                    step < warmup
             = lr                                                          constant
             = lr * (min + (1 - min) * (1 + cos(pi * progress)) / 2)       cosine,
               progress = (step - warmup) / (total - warmup)

It imports torch and the trainer config only; like all of the trainer, it must never import the engine,
sync, the controller or the CLI.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from relayrl.trainer.config import TrainerConfig


def lr_factor(step: int, cfg: TrainerConfig, total_steps: int) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def foreach_ok(params) -> bool:
    """The multi-tensor paths cannot mix DTensor shards (TP) with plain (replicated) tensors."""
    return len({isinstance(p, DTensor) for p in params}) <= 1


def adam_kernel(params) -> dict[str, bool]:
    """AdamW's implementation for these parameters: the fused kernel (one pass over each tensor's four arrays) where
    the parameters are all plain tensors or all DTensor shards, else the per-tensor loop. Fused is elementwise, as
    the others are, and on the CPU it measured 7x the foreach path's speed (13 ms against 90 ms a step for the 25M
    model's parameters, one thread). Also re-applied after loading an optimizer state saved on another layout,
    which carries its own choice."""
    return {"fused": foreach_ok(params), "foreach": False}


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig, total_steps: int):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay, **adam_kernel(params),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg, total_steps))
    return opt, sched
