"""This module computes token logprobs (and entropy) from vocab-sharded logits, without gathering the
vocabulary, and from whole-vocabulary logits with a backward of its own (token_logprobs_from_logits, at the end).

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
    z = local_logits.float() / temperature
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
# The whole vocabulary on this rank:
#
#     z       = logits / temperature                       (no division at temperature 1)
#     logp[r] = log_softmax(z[r])[t[r]] = (z[r, t] - m) - log s,   m = max z[r],  s = sum exp(z[r] - m)
#     H[r]    = log s - sum_v p[r, v] (z[r, v] - m),     p = softmax(z[r]) = exp(z[r] - m) / s
#     d logp[r] / d z[r] = onehot(t[r]) - p[r]
#
# Why not log_softmax, gather and autograd: that keeps the [rows, V] log_softmax output for backward, and its
# backward fills a zero [rows, V] tensor for the gather, scatters into it, then reads it and the output again; the
# division by the temperature adds a pass each way even at 1. Here the forward keeps p (one [rows, V] tensor, as
# before) and backward is one pass (-g p) and a scatter of g into the targets' slots. The numbers are
# log_softmax's formula; tests/test_token_logprob.py checks them and their gradients against log_softmax + gather.
# A gradient through the entropy (entropy_coef != 0) takes the autograd form.


class _TokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
        zs = z - z.amax(-1, keepdim=True)  # z - m: <= 0, so the entropy's two terms below are both >= 0
        zs_t = zs.gather(-1, targets[..., None]).squeeze(-1)
        p = zs.exp() if with_entropy else zs.exp_()
        s = p.sum(-1, keepdim=True)
        log_s = s.log()
        p.div_(s)
        ctx.save_for_backward(p, targets)
        logp = zs_t - log_s.squeeze(-1)
        if not with_entropy:
            return logp, None
        ent = log_s.squeeze(-1) - zs.mul_(p).sum(-1)  # -sum p log p = log s - sum p (z - m)
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g: torch.Tensor, _g_ent):
        p, targets = ctx.saved_tensors
        dz = p * -g[..., None]
        dz.scatter_add_(-1, targets[..., None], g[..., None])
        return dz, None, None


def token_logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                               with_entropy: bool = False, entropy_grad: bool = True):
    """(logp [...], entropy [...] or None) of targets [...] under logits [..., V] / temperature, fp32.
    entropy_grad=False: the entropy is a statistic (no gradient, no graph)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    if with_entropy and entropy_grad:  # the entropy is part of the loss: autograd's form, which differentiates it
        logp_all = z.log_softmax(-1)
        return logp_all.gather(-1, targets[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)
    if not torch.is_grad_enabled() or not z.requires_grad:  # nothing to keep for a backward
        return _TokenLogprob.forward(_NoCtx(), z, targets, with_entropy)
    return _TokenLogprob.apply(z, targets, with_entropy)


class _NoCtx:
    """A stand-in for autograd's ctx when nothing needs a gradient (a no-grad pass keeps nothing)."""

    def save_for_backward(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass
