"""This module computes token logprobs (and entropy) from vocab-sharded logits, without gathering the
vocabulary.

Rank r of the TP group holds z[..., r*Vl : (r+1)*Vl] (Vl = V / tp, equal shards, as the TP plan
requires). With z already divided by the temperature:

    m     = max over ranks of max_local z                      (all-reduce MAX; a shift, no gradient)
    S     = sum over ranks of sum_local exp(z - m)              (all-reduce SUM)
    lse   = log S + m
    z_y   = sum over ranks of (z[y - r*Vl] if y is in rank r's range else 0)   (all-reduce SUM)
    logp  = z_y - lse
    H     = lse - (sum over ranks of sum_local exp(z - m) * z) / S

Communication per token: three (four with entropy) scalars instead of V logits. The sums use
reduce_from_group (all-reduce forward, identity backward): the loss downstream is the same on every
TP rank, so each rank's gradient for its shard is just the local Jacobian (softmax / one-hot terms)
times that loss's gradient — the same numbers as the single-process log_softmax backward.

It imports torch and the parallel collectives only; it must never import another relayrl layer (models,
single_controller, the trainer, the engine, ...): they import it.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor

from relayrl.parallel.collectives import all_reduce_max, reduce_from_group


def _parts(local_logits: Tensor, targets: Tensor, group, temperature: float, with_entropy: bool,
           entropy_grad: bool = True):
    z = scaled(local_logits, temperature)
    vl = z.shape[-1]
    start = dist.get_rank(group) * vl
    m = all_reduce_max(z.max(dim=-1).values, group)
    e = (z - m[..., None]).exp()
    s = reduce_from_group(e.sum(dim=-1), group)
    lse = s.log() + m
    idx = targets - start
    mine = (idx >= 0) & (idx < vl)
    z_y_local = z.gather(-1, idx.clamp(0, vl - 1)[..., None]).squeeze(-1) * mine
    logp = reduce_from_group(z_y_local, group) - lse
    if not with_entropy:
        return logp, None
    with nullcontext() if entropy_grad else torch.no_grad():  # a statistic: e * z keeps no z for backward
        ent = lse - reduce_from_group((e * z).sum(dim=-1), group) / s
    return logp, ent


def vocab_parallel_logprobs(local_logits: Tensor, targets: Tensor, group=None, temperature: float = 1.0) -> Tensor:
    """log_softmax(full logits / temperature)[targets], fp32, [B, T], from local_logits [B, T, V/tp]."""
    return _parts(local_logits, targets, group, temperature, with_entropy=False)[0]


def vocab_parallel_logprobs_and_entropy(
    local_logits: Tensor, targets: Tensor, group=None, temperature: float = 1.0, grad: bool = True
) -> tuple[Tensor, Tensor]:
    """(logp, entropy) [B, T] of the temperature-scaled full distribution, both differentiable (grad=False: the
    entropy without a graph, a statistic)."""
    return _parts(local_logits, targets, group, temperature, with_entropy=True, entropy_grad=grad)


# ---------------------------------------------------------------------------------------------
# The whole vocabulary on this rank (no TP group): the trainer's and the pipeline's last stage's one form.


def scaled(logits: Tensor, temperature: float) -> Tensor:
    """logits / temperature in fp32. At temperature 1 no division: x / 1 is x exactly in IEEE arithmetic (and its
    backward, g / 1, is g), so skipping it changes no bit and saves a [rows, V] pass each way."""
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


def full_vocab_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, with_entropy: bool = False,
                        entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
    """(log_softmax(logits / temperature)[targets], entropy or None), fp32. entropy_grad=False: the entropy is a
    statistic (no graph, so backward keeps no exp(log p) of [rows, V] beside log_softmax's output)."""
    logp_all = scaled(logits, temperature).log_softmax(-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    if not with_entropy:
        return logp, None
    with nullcontext() if entropy_grad else torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent
