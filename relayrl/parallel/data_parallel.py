"""This module applies data parallelism: FSDP2 (fully_shard, ZeRO-3), HSDP on a 2-D mesh, and DDP
(composable replicate).

Gradients are SUMMED over data-parallel ranks by default, not averaged: relayrl's losses divide by
the token / sequence counts of the GLOBAL batch (relayrl.algorithms.aggregation), so each rank's
loss is already its share of the full-batch loss and the full gradient is the sum of the ranks'.
(grad_reduce="mean" gives the usual average, for losses normalised per rank.)

FSDP grouping (one all-gather / reduce-scatter per group):

    fully_shard(layer) for each decoder layer     reshard_after_forward=True: ZeRO-3, params are
    fully_shard(root)                             gathered again in backward — but not the last layer's
                                                  nor the root's (torchtitan's default policy): backward
                                                  starts with them, so freeing them after forward would
                                                  only all-gather them again at once; a
                                                  no-grad forward (old-logprob, reference and
                                                  canary passes) has no backward to reshard
                                                  them, so the root does it after its forward
    on the CPU: each layer's all-gather is issued asynchronously one layer ahead (_prefetch_on_cpu)
      └─ embed_tokens, norm, lm_head — and a tied lm_head.weight IS embed_tokens.weight, one
         parameter in one group, so the tie survives sharding (its two gradient contributions are
         accumulated before the root group's single reduce-scatter).

It imports torch and relayrl.errors only; it must never import another relayrl layer (models,
single_controller, the trainer, the engine, ...): they import it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from relayrl.errors import ConfigError

GRAD_REDUCE = ("sum", "mean")


def _check_reduce(grad_reduce: str) -> None:
    if grad_reduce not in GRAD_REDUCE:
        raise ConfigError(f"grad_reduce must be one of {GRAD_REDUCE}, got {grad_reduce!r}")


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    grad_reduce: str = "sum",
) -> nn.Module:
    """fully_shard each decoder layer, then the root (in place). A 2-D mesh (dp_replicate, dp_shard)
    gives HSDP: sharded within a row, replicated (gradients all-reduced) across rows."""
    _check_reduce(grad_reduce)
    kw = dict(mesh=mesh)
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    layers = list(model.model.layers)
    for i, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=reshard_after_forward and i < len(layers) - 1, **kw)
    fully_shard(model, reshard_after_forward=False, **kw)
    model.register_forward_hook(_reshard_after_no_grad_forward)  # after FSDP's own post-forward hook
    if mesh.device_type == "cpu":
        _prefetch_on_cpu(layers)
    if grad_reduce == "sum":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # SUM collectives, divided by 1: portable (gloo has no PREMUL_SUM) and exact
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    return model


def _prefetch_on_cpu(layers: list) -> None:
    """On the CPU FSDP2 has no streams, so each layer's all-gather blocks where it is needed. Issued one layer
    ahead (the next layer's in forward, the previous one's in backward) and asynchronously, gloo's own thread
    moves it while this layer computes: FSDP 2 went from 0.94x to 0.96-0.97x of one process in bench_trainer
    (RESULTS.md). On CUDA, FSDP2's own stream-based prefetching already overlaps them."""
    for layer in layers:
        layer._set_unshard_async_op(True)
    for a, b in zip(layers, layers[1:], strict=False):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])


def _reshard_after_no_grad_forward(model: nn.Module, _args, output):
    """Without a backward to come, the groups kept unsharded after forward are resharded at once (else a frozen
    reference model would hold them whole for good, and the sync would read whole tensors for shards)."""
    if not torch.is_grad_enabled():
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    return output


def _allreduce_sum_hook(group, bucket):
    """DDP comm hook: sum the bucket over the group (the default hook averages)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def apply_ddp(model: nn.Module, mesh: DeviceMesh, *, grad_reduce: str = "sum") -> nn.Module:
    """Replicate `model` over a 1-D mesh (DDP semantics, bucketed all-reduce), in place.

    Uses the composable replicate (the DDP engine without the wrapper), so parameter names stay the
    Hugging Face ones that checkpoints and weight sync rely on."""
    from torch.distributed._composable.replicate import replicate

    _check_reduce(grad_reduce)
    if mesh.ndim != 1:
        raise ConfigError(f"DDP takes a 1-D data-parallel mesh, got {mesh.ndim}-D {mesh.mesh_dim_names}")
    replicate(model, device_mesh=mesh, gradient_as_bucket_view=True)  # no second copy of the gradients
    if grad_reduce == "sum":
        model.register_comm_hook(mesh.get_group(), _allreduce_sum_hook)
    return model
