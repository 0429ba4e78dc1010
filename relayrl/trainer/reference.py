"""The reference model: the frozen policy a KL term anchors to (algo.kl_coef), and how its logprobs are computed.

    Reference(model, ...)          the frozen weights (eval, no gradients) and the trainer's settings for them:
        compute_ref_logprobs(batch)  ref_logp [B, T] of the response tokens (0 elsewhere), forward only
                                     (relayrl.trainer.logprobs.LogprobRunner), back on the batch's device

Its pass is the actor's old-logprob pass with two settings of its own: no autocast (the reference computes in its
own dtype) and plain chunks of micro_batch_size rows (every data-parallel rank running as many: a sharded
reference's forwards are collective). It packs rows (padding_free, shared prefixes) and replays
an MoE's routing (routing_replay) as the trainer does, so its logprobs and the actor's at equal weights agree.

With trainer.lora no reference model is built: the actor's frozen base is the reference
(relayrl.trainer.actor.Actor.compute_ref_logprobs, the same runner with the adapters off). Where the reference
runs is the roles' business (relayrl.roles.actor_workers.ReferenceWorker builds it under `parallel.*`).

It imports torch, relayrl.models, relayrl.parallel and the trainer's own modules only; like all of the trainer, it
must never import the engine, sync, the controller or the CLI.
"""

from __future__ import annotations

import torch

from relayrl.models import CausalLM
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.pipeline import Pipeline
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.logprobs import LogprobRunner


class Reference:
    """The frozen reference model. dims: its parallel layout (already applied, as the Actor's); cp, pipe: its
    context-parallel wrapper and pipeline over this rank's stages, as the Actor's; device: where its micro-batches
    go (default: the model's)."""

    def __init__(self, model: CausalLM, *, temperature: float, micro_batch_size: int, padding_free: bool = False,
                 shared_prefix: bool = False, routing_replay: bool = False, dims: ParallelDims | None = None,
                 cp=None, pipe: Pipeline | None = None, device=None):
        self.model = model.eval().requires_grad_(False)
        tp_group = dims.tp_mesh.get_group() if dims is not None and dims.tp > 1 else None
        dp_group = dims.dp_mesh.get_group() if dims is not None and dims.dp > 1 else None
        self.logprobs = LogprobRunner(model, temperature, micro_batch_size, device, padding_free=padding_free,
                                      shared_prefix=shared_prefix, routing_replay=routing_replay, bf16=False,
                                      even=False, tp_group=tp_group, dp_group=dp_group, cp=cp, pipe=pipe)

    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.logprobs(batch)
