"""This module defines the differentiable collectives for tensor / sequence parallelism, as autograd
Functions.

Which backward a collective needs depends on what follows it (Megatron's f / g operators):

    downstream computes the SAME value on every rank (replicated loss):
        copy_to_group        fwd: identity            bwd: all-reduce      ("f": enter a parallel region)
        reduce_from_group    fwd: all-reduce (sum)    bwd: identity        ("g": leave it)
        gather_from_group    fwd: all-gather on dim   bwd: keep own chunk
        scatter_to_group     fwd: keep own chunk      bwd: all-gather on dim
    downstream computes DIFFERENT partial values per rank (summed over ranks; sequence parallel):
        all_gather_seq       fwd: all-gather on dim   bwd: reduce-scatter on dim
        reduce_scatter_seq   fwd: reduce-scatter      bwd: all-gather on dim

Chunks are equal: the size of `dim` must be divisible by the group size where it is split.

It imports torch only; it must never import another relayrl layer (models, single_controller, the
trainer, the engine, ...): they import it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _all_reduce(x: Tensor, group, op=dist.ReduceOp.SUM) -> Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x: Tensor, dim: int, group) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _chunk(x: Tensor, dim: int, group) -> Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} into {n} equal chunks")
    return x.chunk(n, dim=dim)[r].contiguous()


def _reduce_scatter(x: Tensor, dim: int, group) -> Tensor:
    n = dist.get_world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {n} ranks")
    parts = [p.contiguous() for p in x.chunk(n, dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=group)
    return out


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _chunk(grad, ctx.dim, ctx.group), None, None


class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _chunk(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_group(x: Tensor, group=None) -> Tensor:
    """Identity forward, all-reduce backward (replicated input feeding rank-local compute)."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: Tensor, group=None) -> Tensor:
    """All-reduce (sum) forward, identity backward (partial sums feeding a replicated loss)."""
    return _ReduceFromGroup.apply(x, group)


def gather_from_group(x: Tensor, dim: int = -1, group=None) -> Tensor:
    """All-gather along dim forward, own chunk backward (the gathered tensor feeds a replicated loss)."""
    return _GatherFromGroup.apply(x, dim, group)


def scatter_to_group(x: Tensor, dim: int = -1, group=None) -> Tensor:
    """Own chunk forward, all-gather backward."""
    return _ScatterToGroup.apply(x, dim, group)


def all_gather_seq(x: Tensor, dim: int = 1, group=None) -> Tensor:
    """All-gather along dim forward, reduce-scatter backward (sequence parallel → tensor parallel)."""
    return _AllGatherSeq.apply(x, dim, group)


def reduce_scatter_seq(x: Tensor, dim: int = 1, group=None) -> Tensor:
    """Reduce-scatter along dim forward, all-gather backward (tensor parallel → sequence parallel)."""
    return _ReduceScatterSeq.apply(x, dim, group)


def all_reduce_max(x: Tensor, group=None) -> Tensor:
    """Element-wise max over the group; not differentiable (use it for stabilising shifts)."""
    return _all_reduce(x.detach(), group, op=dist.ReduceOp.MAX)
