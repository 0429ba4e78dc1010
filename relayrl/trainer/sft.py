"""This module runs supervised fine-tuning on prompt/answer pairs (loss on the answer only), to warm-start
a policy.

    loss = - sum_{answer tokens} log p(token | prefix) / (number of answer tokens in the batch)

Micro-batches use the batch's token count as denominator, so accumulation equals the full batch.

It imports torch, relayrl.models, relayrl.parallel and the trainer's own modules only; like all of the
trainer, it must never import the engine, sync, the controller or the CLI.
"""

from __future__ import annotations

import torch

from relayrl.models import CausalLM
from relayrl.parallel.device import module_device
from relayrl.parallel.grad_norm import clip_grad_norm
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.config import TrainerConfig
from relayrl.trainer.logprobs import token_logprobs
from relayrl.trainer.nonfinite import NonFiniteGuard, step_schedule
from relayrl.trainer.optim import build_optimizer


class SFTTrainer:
    def __init__(self, model: CausalLM, cfg: TrainerConfig, total_steps: int):
        self.model, self.cfg = model, cfg
        self.device = module_device(model)  # micro-batches go here; autocast takes its type
        self.optimizer, self.scheduler = build_optimizer(model, cfg, total_steps)
        self.guard = NonFiniteGuard(cfg.max_nonfinite_steps, device=self.device, who="model")

    def step(self, batch: TrainBatch) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = batch.response_mask.sum().clamp(min=1)
        total = 0.0
        for mb in batch.split(self.cfg.micro_batch_size):
            mb = mb.to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
                logp, _ = token_logprobs(self.model, mb.input_ids, mb.attention_mask,
                                         padding_free=self.cfg.padding_free)
            loss = -(logp * mb.response_mask).sum() / num_tokens
            loss.backward()
            total += float(loss.detach())
        clip = self.cfg.grad_clip if self.cfg.grad_clip is not None else float("inf")
        grad_norm = clip_grad_norm(self.model.parameters(), clip)
        cause = self.guard.check(total, grad_norm)  # a non-finite step is skipped (relayrl.trainer.nonfinite)
        if cause is None:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.guard.stop_if_exhausted(cause, total if cause == "loss" else grad_norm,
                                         step=self.scheduler.last_epoch + 1)
        step_schedule(self.scheduler)
        return {"sft/loss": total, "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0],
                "skipped_nonfinite": float(self.guard.take_skipped())}
