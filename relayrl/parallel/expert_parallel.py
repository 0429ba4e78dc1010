"""Expert parallelism: each of the ep ranks holds E / ep whole experts, and every MoE layer sends its tokens to
the ranks holding their experts and back (dropless: no capacity, every routed pair is computed).

Per MoE layer on ep rank r (its own N tokens, k slots each; experts r E_l .. (r + 1) E_l - 1, E_l = E / ep):

    router (replicated, as every dense parameter)  weights, idx [N, k]    the block's own code (relayrl.models.moe)
    sort the N k (token, slot) pairs by expert      → grouped by destination rank (experts are contiguous per rank)
    counts [E] ──all-to-all──> recv [ep, E_l]       how many pairs rank s sends to each of my experts
    x[token] ──all-to-all (splits from counts)──>   rows by source rank, then by my expert
        regroup by expert; expert e runs once on its rows (all sources); regroup back
    ──all-to-all (the splits swapped)──> [N k, h]   each pair's expert output, back in the sorted order
    out[token] += weight · output                    the combine, local: the router's gradient stays local

The counts go first, so both all-to-alls have their variable splits (one host sync per layer, as the one-process
dispatch's bincount). The all-to-all is its own backward with the splits swapped, so autograd is exact: an
expert's gradient sums over every token of the ep group that chose it, and FSDP then sums it over the efsdp
ranks holding the same experts. An expert with no rows, or a rank that receives none, still runs on an empty
chunk and takes part in every collective, so each rank's graph and collectives are the same whatever the routing.

    experts = apply_expert_parallel(model, dims.ep_mesh)   # parallelize_model does it, after TP, before AC / FSDP
    shard_experts(model, dims.expert_fsdp_mesh)            # the experts' own FSDP groups, before the layers'

A block's `experts` becomes an nn.ModuleDict of this rank's experts keyed by their global index, so parameter
names stay the checkpoint's (`mlp.experts.{j}.gate_proj.weight`, `block_sparse_moe.experts.{j}.w1.weight`); each
rank's state dict holds its own experts only. Gradient clipping must count every expert once: `grad_norm_ep`.

It imports torch, relayrl.errors and the parallel modules only; it finds MoE blocks by their `experts_fn`,
`experts` and `num_experts` attributes and never imports relayrl.models.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from relayrl.errors import ConfigError
from relayrl.parallel.grad_norm import grad_norm


def check_experts_divide(num_experts: int, ep: int) -> None:
    if num_experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the model's num_experts={num_experts}: each ep rank "
                          "holds num_experts / ep whole experts")


def _all_to_all_v(x: Tensor, recv: list[int], send: list[int], group) -> Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllToAllV(torch.autograd.Function):
    """Rows x[send[0] rows → rank 0, ...] out, recv[s] rows from rank s in; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, recv, send, group):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _all_to_all_v(x, recv, send, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_v(grad, ctx.send, ctx.recv, ctx.group), None, None, None


class ExpertParallel:
    """A block's experts_fn on one ep rank: dispatch, this rank's experts, combine (module docstring)."""

    def __init__(self, num_experts: int, group):
        self.group = group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        check_experts_divide(num_experts, self.ep)
        self.num_experts, self.num_local = num_experts, num_experts // self.ep
        self.local = range(self.rank * self.num_local, (self.rank + 1) * self.num_local)

    def __call__(self, experts: nn.ModuleDict, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
        E, ep, El = self.num_experts, self.ep, self.num_local
        top_k = idx.shape[1]
        pair_expert = idx.reshape(-1)
        order = torch.argsort(pair_expert, stable=True)
        token = order // top_k  # the token of each sorted (token, slot) pair
        counts = torch.bincount(pair_expert, minlength=E)  # pairs this rank sends to each expert
        recv_counts = torch.empty_like(counts)  # [ep E_l]: rank s's pairs for my expert e at s E_l + e
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        both = torch.cat([counts, recv_counts]).tolist()  # the one host sync
        sent_c, recv_c = both[:E], both[E:]
        send = [sum(sent_c[r * El:(r + 1) * El]) for r in range(ep)]
        recv = [sum(recv_c[s * El:(s + 1) * El]) for s in range(ep)]
        per_expert = [sum(recv_c[s * El + e] for s in range(ep)) for e in range(El)]

        rows = _AllToAllV.apply(x[token], recv, send, self.group)  # by source rank, then by my expert
        expert_of_row = torch.arange(El, device=x.device).repeat(ep).repeat_interleave(recv_counts,
                                                                                      output_size=sum(recv))
        by_expert = torch.argsort(expert_of_row, stable=True)
        chunks = rows[by_expert].split(per_expert)
        y = torch.cat([expert(c) for expert, c in zip(experts.values(), chunks, strict=True)])
        y = y[torch.argsort(by_expert)]  # back to source-rank order
        back = _AllToAllV.apply(y, send, recv, self.group)  # [N k, h]: each sorted pair's expert output

        out = torch.zeros_like(x)
        out.index_add_(0, token, (back * weights.reshape(-1)[order][:, None]).to(out.dtype))
        return out


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of every MoE block: the modules with a swappable experts_fn."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "experts_fn") and hasattr(m, "experts")]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[ExpertParallel]:
    """Keep this rank's E / ep experts of every MoE block (keyed by their global index) and swap its experts_fn
    for the all-to-all dispatch over ep_mesh; in place. A model without MoE blocks, or with E not divisible by
    ep, is refused in one line."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ConfigError("parallel.ep > 1, but the model has no MoE block (one with an experts_fn) to shard")
    for _, block in blocks:  # every check before any block changes
        if isinstance(block.experts_fn, ExpertParallel):
            raise RuntimeError("apply_expert_parallel was already applied to this model")
        check_experts_divide(block.num_experts, ep_mesh.size())
    group = ep_mesh.get_group()
    swapped = []
    for _, block in blocks:
        fn = ExpertParallel(block.num_experts, group)
        block.experts = nn.ModuleDict({str(j): block.experts[j] for j in fn.local})
        block.experts_fn = fn
        swapped.append(fn)
    return swapped


def shard_experts(model: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool = True,
                  mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """fully_shard each of this rank's experts over `mesh` (ParallelDims.expert_fsdp_mesh: the ranks holding the same
    experts), before the layers' own fully_shard, which then leaves them out. A size-1 mesh still shards, so the
    experts' gradients skip the dense group's reduction (they already sum the whole ep group's tokens)."""
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for _, block in moe_blocks(model):
        if not isinstance(block.experts_fn, ExpertParallel):
            raise RuntimeError("shard_experts runs after apply_expert_parallel")
        for expert in block.experts.values():
            fully_shard(expert, **kw)


def expert_fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """This rank's experts (each its own FSDP module after shard_experts)."""
    return [e for _, block in moe_blocks(model) if isinstance(block.experts_fn, ExpertParallel)
            for e in block.experts.values()]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the experts expert parallelism placed on this rank (each on this rank only)."""
    return [p for _, block in moe_blocks(model) if isinstance(block.experts_fn, ExpertParallel)
            for p in block.experts.parameters()]


def grad_norm_ep(model: nn.Module, ep_mesh: DeviceMesh) -> float:
    """sqrt(Σ ||grad||²) of the whole model under EP: the dense parameters' as grad_norm gives them, plus the
    experts' summed over the ep ranks (each holds other experts)."""
    sparse = expert_parameters(model)
    ids = {id(p) for p in sparse}
    dense = [p for p in model.parameters() if id(p) not in ids]
    return math.hypot(grad_norm(dense), grad_norm(sparse, group=ep_mesh.get_group()))
