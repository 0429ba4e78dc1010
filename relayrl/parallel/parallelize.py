"""parallelize_model is the one ordered function that turns a plain CausalLM into a parallel one.

    plain model (same weights on every rank)
      1. tensor parallel      plan as data → DTensor shards on mesh["tp"]          (tp > 1)
      2. expert parallel      each MoE block keeps E / ep experts, all-to-all dispatch over dims.ep_mesh (ep > 1)
      3. activation ckpt      each decoder layer recomputes its forward in backward (optional)
      4. data parallel        fsdp: fully_shard per layer + root on dp_shard (HSDP with dp_replicate;
                                    dp_shard x cp with context parallelism, whose ranks hold the same
                                    parameters: dims.fsdp_mesh); with ep > 1 each expert first, over the
                                    ranks holding the same experts (dims.expert_fsdp_mesh)
                              ddp:  replicate over dims.dp_mesh (all data-parallel ranks); never with ep > 1, which
                                    needs dp_shard x cp > 1, which dp_mode='ddp' refuses

Context parallelism is not one of these steps: it swaps each attention module's computation
(relayrl.parallel.context_parallel.apply_context_parallel on dims.cp_mesh), which no step above touches, so
it may be applied before or after; the caller keeps the object it returns to run the model.

Pipeline parallelism comes before all of them: the model is cut into this rank's stages first
(relayrl.models.stage.split_model on relayrl.parallel.pipeline.rank_stages), and each stage module, which keeps
the Hugging Face names, goes through this function as a whole model would.

The order matters: FSDP shards the DTensors TP produced (2-D parameters), and checkpointing sits
inside the FSDP unit so recompute happens while the layer's parameters are gathered. EP comes before
FSDP (as in torchtitan) so that FSDP shards the experts this rank keeps, in groups of their own.
Everything is in place; module and parameter names stay the Hugging Face ones.

It imports torch, relayrl.errors and the parallel modules only; it never imports relayrl.models (it
works on any module with the Hugging Face names), and it must never import another relayrl layer
(models, single_controller, the trainer, the engine, ...): they import it.
"""

from __future__ import annotations

import functools

import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from relayrl.errors import ConfigError
from relayrl.parallel.data_parallel import apply_ddp, apply_fsdp
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.expert_parallel import apply_expert_parallel, expert_fsdp_modules, shard_experts
from relayrl.parallel.tensor_parallel import apply_tensor_parallel

DP_MODES = ("fsdp", "ddp")


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each decoder layer's forward during backward (non-reentrant checkpoint).

    The layer's own forward is replaced on the instance instead of wrapping the module, so names do
    not gain a wrapper prefix and module hooks (FSDP, TP) still run around the checkpointed region."""
    for layer in model.model.layers:
        if getattr(layer, "_relayrl_checkpointed", False):
            continue
        inner = layer.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return torch.utils.checkpoint.checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
        layer._relayrl_checkpointed = True
    return model


def parallelize_model(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    *,
    activation_checkpointing: bool = False,
    dp_mode: str = "fsdp",
    gather_logits: bool = False,
    sequence_parallel: bool = False,
    grad_reduce: str = "sum",
    reshard_after_forward: bool = True,
    mp_policy=None,
) -> nn.Module:
    """Apply TP → EP → activation checkpointing → data parallel to `model` in place; return it.

    With tp > 1 the model returns vocab-sharded logits [B, T, V/tp] unless gather_logits;
    sequence_parallel shards norms and residuals on the sequence between TP regions.
    grad_reduce="sum" (default) sums gradients over data-parallel ranks, matching losses that
    divide by global token counts (see relayrl.parallel.data_parallel)."""
    if dp_mode not in DP_MODES:
        raise ConfigError(f"dp_mode must be one of {DP_MODES}, got {dp_mode!r}")
    if dp_mode == "ddp" and dims.dp_shard > 1:
        raise ConfigError(f"dp_mode='ddp' replicates the model, but dp_shard={dims.dp_shard}: "
                          "use dp_replicate for DDP, or dp_mode='fsdp' to shard")
    if dp_mode == "ddp" and dims.cp > 1:
        raise ConfigError("dp_mode='ddp' with cp > 1 is not supported; use dp_mode='fsdp' (the cp ranks shard the "
                          "parameters with dp_shard, as in torchtitan)")
    if dp_mode == "ddp" and dims.tp > 1:
        raise ConfigError("dp_mode='ddp' with tp > 1 is not supported; use dp_mode='fsdp' (FSDP / HSDP + TP)")
    if mesh is not dims.mesh:
        raise ConfigError("parallelize_model needs the mesh returned by dims.build_mesh(...)")

    if dims.tp > 1:
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        apply_tensor_parallel(model, mesh["tp"], gather_logits=gather_logits, sequence_parallel=sequence_parallel)
        # some torch styles (SequenceParallel) make every parameter they distribute trainable: a frozen base
        # (LoRA) stays frozen
        for n, p in model.named_parameters():
            if n in frozen:
                p.requires_grad_(False)
    if dims.ep > 1:
        apply_expert_parallel(model, dims.ep_mesh)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if dims.dp * dims.cp > 1:
        if dp_mode == "fsdp":
            if dims.ep > 1:
                shard_experts(model, dims.expert_fsdp_mesh, reshard_after_forward=reshard_after_forward,
                              mp_policy=mp_policy)
            apply_fsdp(model, dims.fsdp_mesh, reshard_after_forward=reshard_after_forward,
                       mp_policy=mp_policy, grad_reduce=grad_reduce)
            if dims.ep > 1 and grad_reduce == "mean":
                # an expert's gradient already sums the ep group's tokens; the mean divides by every
                # data-parallel rank (dp_replicate x dp_shard x cp), as the dense groups do
                for m in expert_fsdp_modules(model):
                    m.set_gradient_divide_factor(float(dims.dp * dims.cp))
                    m.set_force_sum_reduction_for_comms(True)
        else:
            apply_ddp(model, dims.dp_mesh, grad_reduce=grad_reduce)
    return model
