"""The actor: recompute logprobs, and the clipped policy update over one rollout batch.

    batch ──ppo_epochs──> shuffle ──mini_batches──> zero_grad
                                                    micro-batches: forward → objective → backward
                                                    clip grad norm → optimiser step
    scheduler step (once per RL step)

Micro-batches reproduce the mini-batch's full gradient exactly: every micro-batch's loss uses the
mini-batch's token and sequence counts as denominators (see relayrl.algorithms.aggregation), so
the accumulated gradient is the gradient of the full mini-batch loss.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from relayrl.algorithms import AlgoConfig, policy_objective
from relayrl.models import CausalLM
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.config import TrainerConfig
from relayrl.trainer.logprobs import token_logprobs
from relayrl.trainer.optim import build_optimizer


class Actor:
    def __init__(self, model: CausalLM, cfg: TrainerConfig, algo: AlgoConfig, total_steps: int, temperature: float = 1.0, seed: int = 0):
        self.model = model
        self.cfg, self.algo = cfg, algo
        self.temperature = temperature
        self.optimizer, self.scheduler = build_optimizer(model, cfg, total_steps)
        self.shuffle_gen = torch.Generator().manual_seed(seed)

    def _autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.cfg.bf16 else contextlib.nullcontext()

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Logprobs [B, T] under the current weights, in micro-batches (no grad)."""
        self.model.eval()
        parts = []
        for mb in batch.split(self.cfg.micro_batch_size):
            with self._autocast():
                logp, _ = token_logprobs(self.model, mb.input_ids, mb.attention_mask, self.temperature,
                                         padding_free=self.cfg.padding_free)
            parts.append(logp * mb.response_mask)
        return torch.cat(parts)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        self.model.train()
        stats: dict[str, list[float]] = defaultdict(list)
        n = len(batch)
        mini_size = -(-n // self.cfg.mini_batches)
        for _ in range(self.cfg.ppo_epochs):
            order = torch.randperm(n, generator=self.shuffle_gen) if self.cfg.shuffle else torch.arange(n)
            for start in range(0, n, mini_size):
                mini = batch.select(order[start:start + mini_size])
                for k, v in self.step_on(mini).items():
                    stats[k].append(v)
        self.scheduler.step()
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        out["lr"] = self.scheduler.get_last_lr()[0]
        return out

    def step_on(self, mini: TrainBatch) -> dict[str, float]:
        """One optimiser step on a mini-batch (accumulated over micro-batches)."""
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.accumulate_grads(mini)
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.grad_clip if self.cfg.grad_clip is not None else float("inf")
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, clip))
        self.optimizer.step()
        return stats

    def accumulate_grads(self, mini: TrainBatch) -> dict[str, float]:
        num_tokens = mini.response_mask.sum().clamp(min=1)
        num_seqs = float(len(mini))
        want_entropy = True  # reported every step; it only carries gradient when entropy_coef != 0
        sums: dict[str, float] = defaultdict(float)
        weight_total = 0.0
        for mb in mini.split(self.cfg.micro_batch_size):
            with self._autocast():
                logp, ent = token_logprobs(self.model, mb.input_ids, mb.attention_mask, self.temperature,
                                           with_entropy=want_entropy, padding_free=self.cfg.padding_free)
            if self.algo.entropy_coef == 0 and ent is not None:
                ent = ent.detach()
            loss, st = policy_objective(
                logp, mb.old_logp, mb.advantages, mb.response_mask, self.algo,
                rollout_logp=mb.rollout_logp, ref_logp=mb.ref_logp, entropy=ent,
                num_tokens=num_tokens, num_seqs=num_seqs,
            )
            loss.backward()
            # stats are token means over each micro-batch: weight them by its token count
            w = float(mb.response_mask.sum())
            weight_total += w
            sums["loss"] += float(loss.detach())
            for k, v in st.items():
                if k != "ratio_max":
                    sums[k] += float(v) * w
            sums["ratio_max"] = max(sums["ratio_max"], float(st.get("ratio_max", 0.0)))
        out = {k: (v if k in ("loss", "ratio_max") else v / max(weight_total, 1.0)) for k, v in sums.items()}
        return out
