"""The Actor recomputes logprobs and runs the clipped policy update over one rollout batch.

    batch ──ppo_epochs──> shuffle ──mini_batches──> zero_grad
                                                    micro-batches: forward → objective → backward
                                                    clip grad norm → optimiser step
    scheduler step (once per RL step)

Micro-batches reproduce the mini-batch's full gradient exactly: every micro-batch's loss uses the
mini-batch's token and sequence counts as denominators (see relayrl.algorithms.aggregation), so
the accumulated gradient is the gradient of the full mini-batch loss.

MoE models (relayrl.trainer.routing): with algo.routing_replay every forward replays the engine's routing
(batch.routing); the update reports moe/routing_mismatch and the expert load, and adds the routers' auxiliary
losses when their coefficients are set. Under expert parallelism the gradient norm counts every rank's experts.

Pipeline parallelism (`pipe`, relayrl.parallel.pipeline): the model is this pp rank's stages (merged under the
full model's names, for the optimizer and checkpoints); every pass runs through the pipeline in equal micro-batches
(relayrl.trainer.pipelined), each micro-batch's loss the same share of the mini-batch loss as without it. The last
stage computes the losses and their stats; the update's result is broadcast to the other pp ranks.

It imports torch, relayrl.algorithms, relayrl.models, relayrl.parallel and the trainer's own modules
only; like all of the trainer, it must never import the engine, sync, the controller or the CLI.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from relayrl.algorithms import AlgoConfig, mismatch_stats, policy_objective
from relayrl.models import CausalLM
from relayrl.models.lora import set_lora_enabled
from relayrl.parallel.device import module_device
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.expert_parallel import grad_norm_ep
from relayrl.parallel.grad_norm import clip_grad_norm, scale_grads
from relayrl.parallel.pipeline import Pipeline, TokenLoss
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.config import TrainerConfig
from relayrl.trainer.logprobs import (
    LogprobRunner,
    autocast,
    per_token,
    prompt_lens,
    prompt_order,
    split_rows,
    token_logprobs,
)
from relayrl.trainer.nonfinite import NonFiniteGuard, step_schedule
from relayrl.trainer.optim import build_optimizer
from relayrl.trainer.pipelined import micro_batches, pad_rows
from relayrl.trainer.routing import (
    load_metrics,
    moe_shape,
    replay_routing,
    routed_load,
    router_losses,
    routing_mismatch,
)


class Actor:
    """dims: the model's parallel layout (already applied with relayrl.parallel.parallelize_model).
    Each data-parallel rank then updates on its own rows of the global batch: the loss denominators
    are the GLOBAL token / sequence counts (an all-reduce over the data-parallel group) and the
    gradients are summed over ranks, so every layout takes the single-process step."""

    def __init__(self, model: CausalLM, cfg: TrainerConfig, algo: AlgoConfig, *, total_steps: int,
                 temperature: float = 1.0, seed: int = 0, dims: ParallelDims | None = None, cp=None,
                 pipe: Pipeline | None = None):
        self.model = model
        self.cp = cp  # context parallelism: forwards go through it (relayrl.parallel.context_parallel)
        self.pipe = pipe  # pipeline parallelism: model is merge_stages(pipe.modules); passes go through pipe
        self.device = module_device(model)  # micro-batches go here; autocast takes its type
        self.cfg, self.algo = cfg, algo
        self.temperature = temperature
        self.dp_group = dims.dp_mesh.get_group() if dims is not None and dims.dp > 1 else None
        self.tp_group = dims.tp_mesh.get_group() if dims is not None and dims.tp > 1 else None
        self.ep_mesh = dims.ep_mesh if dims is not None and dims.ep > 1 else None
        self.moe = moe_shape(model)  # None: a dense model
        if self.moe is None and algo.uses_router:
            raise ValueError("algo.routing_replay, algo.moe_aux_loss_coef and algo.moe_z_loss_coef need an MoE "
                             f"model; {getattr(model.config, 'model_type', 'this model')} has no experts")
        self.optimizer, self.scheduler = build_optimizer(model, cfg, total_steps)
        # the old-logprob pass (and with trainer.lora the reference's, adapters off): the update's numerics
        self.logprobs = LogprobRunner(model, temperature, cfg.micro_batch_size, self.device,
                                      padding_free=cfg.padding_free, shared_prefix=cfg.shares_prefix,
                                      routing_replay=algo.routing_replay, bf16=cfg.bf16, even=True,
                                      tp_group=self.tp_group, dp_group=self.dp_group, cp=cp, pipe=pipe)
        self.shuffle_gen = torch.Generator().manual_seed(seed)
        # a step with a non-finite loss or gradient norm is skipped on every rank; max_nonfinite_steps in a row stop
        self.guard = NonFiniteGuard(cfg.max_nonfinite_steps, dims=dims, device=self.device, who="actor")

    def _autocast(self):
        return autocast(self.device, self.cfg.bf16)

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Logprobs [B, T] under the current weights, in micro-batches (no grad), as the update's forward computes
        them: under its autocast, its cut of the rows, and as many forwards on every data-parallel rank."""
        return self.logprobs(batch)

    def _prefix_lens(self, mb: TrainBatch) -> list[int] | None:
        """trainer.shared_prefix: each row's prompt, computed once for the rows that share it."""
        return prompt_lens(mb.response_mask, mb.attention_mask) if self.cfg.shares_prefix else None

    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """With trainer.lora the reference model IS the frozen base: this model's logprobs with its adapters
        off (no second model is built). Adapters start at B = 0, so at step 0 they equal compute_logprobs'."""
        if self.cfg.lora is None:
            raise ValueError("compute_ref_logprobs on the actor needs trainer.lora (full fine-tuning has no frozen "
                             "base: its reference is a model of its own)")
        set_lora_enabled(self.model, False)
        try:
            return self.compute_logprobs(batch)
        finally:
            set_lora_enabled(self.model, True)

    def per_token(self, batch: TrainBatch, forward) -> torch.Tensor:
        """forward(micro-batch) -> [b, T] over the batch in micro-batches (no grad), masked to the response
        tokens; every data-parallel rank runs as many micro-batches (see _micro_batches)."""
        self.model.eval()
        return per_token(batch, forward, self._micro_batches(batch, batch), self.cfg.bf16)

    def _micro_batches(self, rows: TrainBatch, template: TrainBatch):
        """`rows` in near-equal micro-batches, the SAME number on every data-parallel rank (stand-ins where a rank
        has fewer; relayrl.trainer.logprobs.split_rows). Yields (micro-batch on the model's device, is_real)."""
        return split_rows(rows, self.cfg.micro_batch_size, self.device, dp_group=self.dp_group, template=template)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """PPO epochs over the batch in mini-batches. Under data parallelism every rank draws the
        same permutation of the GLOBAL row indices and trains on its own rows of each global
        mini-batch, so the mini-batches are those of the single-process run."""
        self.model.train()
        tally = _Tally(self.moe)
        offset, n = 0, len(batch)
        if self.dp_group is not None:  # this rank's rows are [offset, offset + len) of the global batch
            sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(self.dp_group))]
            dist.all_gather(sizes, torch.tensor([len(batch)]), group=self.dp_group)
            offset = int(sum(sizes[: dist.get_rank(self.dp_group)]))
            n = int(sum(sizes))
        mini_size = -(-n // self.cfg.mini_batches)
        for _ in range(self.cfg.ppo_epochs):
            order = torch.randperm(n, generator=self.shuffle_gen) if self.cfg.shuffle else torch.arange(n)
            for start in range(0, n, mini_size):
                glob = order[start:start + mini_size]
                mine = glob[(glob >= offset) & (glob < offset + len(batch))] - offset
                if self.cfg.shares_prefix:  # a prompt's samples in the same micro-batches (a mini-batch is a set)
                    mine = mine[prompt_order(batch.select(mine))]
                self.step_on(batch.select(mine), tally, batch)
        step_schedule(self.scheduler)
        if self.dp_group is not None:
            tally.all_reduce(self.dp_group)
        result = {**tally.result(), "lr": self.scheduler.get_last_lr()[0],
                  "skipped_nonfinite": float(self.guard.take_skipped())}  # the same on every rank (agreed)
        if self.pipe is not None:  # the last stage computed the losses: its stats are the pipeline's
            out = [result]
            dist.broadcast_object_list(out, group=self.pipe.pp_group, group_src=self.pipe.last_rank)
            result = out[0]
        return result

    def step_on(self, mini: TrainBatch, tally: _Tally, template: TrainBatch | None = None) -> None:
        """One optimiser step on a mini-batch (accumulated over micro-batches); skipped, its gradients dropped,
        when the loss or the gradient norm is not finite (relayrl.trainer.nonfinite)."""
        self.optimizer.zero_grad(set_to_none=True)
        tally.step_loss = 0.0
        self._accumulate(mini, tally, template if template is not None else mini)
        clip = self.cfg.grad_clip if self.cfg.grad_clip is not None else float("inf")
        if self.pipe is not None:  # every stage's gradients in one norm (a tied weight once)
            total = self.pipe.clip_grad_norm(clip)
        elif self.ep_mesh is not None:  # each ep rank holds other experts: their squares summed over the ep group
            total = grad_norm_ep(self.model, self.ep_mesh)
            scale_grads(self.model.parameters(), clip, total)
        else:
            total = clip_grad_norm(self.model.parameters(), clip)
        tally.grad_norms.append(total)
        cause = self.guard.check(tally.step_loss, total)
        if cause is not None:
            self.optimizer.zero_grad(set_to_none=True)  # dropped: neither applied nor left for the next step
            value = tally.step_loss if cause == "loss" else total
            self.guard.stop_if_exhausted(cause, value, step=self.scheduler.last_epoch + 1)
            return
        self.optimizer.step()

    def accumulate_grads(self, mini: TrainBatch) -> dict[str, float]:
        """Backward over `mini` (no optimiser step); its local stats."""
        tally = _Tally(self.moe)
        self._accumulate(mini, tally, mini)
        return tally.result()

    def _accumulate(self, mini: TrainBatch, tally: _Tally, template: TrainBatch) -> None:
        if self.pipe is not None:
            return self._accumulate_pipelined(mini, tally, template)
        # response tokens, sequences, real tokens (the routers' losses average over every real token)
        counts = torch.tensor([float(mini.response_mask.sum()), float(len(mini)), float(mini.attention_mask.sum())])
        if self.dp_group is not None:  # the global batch's counts: every rank divides by the same
            dist.all_reduce(counts, group=self.dp_group)
        num_tokens, num_seqs, num_real = counts[0].clamp(min=1), float(counts[1]), max(float(counts[2]), 1.0)
        micro = list(self._micro_batches(mini, template))
        # DDP: all-reduce once, after the last micro-batch. FSDP keeps reducing every micro-batch:
        # deferring it would hold an unsharded gradient of the whole model on every rank (measured).
        set_sync = (None if isinstance(self.model, FSDPModule)
                    else getattr(self.model, "set_requires_gradient_sync", None))
        tally.loss_steps += 1
        for i, (mb, real) in enumerate(micro):
            if set_sync is not None:  # reduce gradients once, after the last micro-batch
                set_sync(i == len(micro) - 1)
            share = float(mb.attention_mask.sum()) / num_real if real else 0.0  # a stand-in's router terms: none
            loss, st = self.loss(mb, num_tokens, num_seqs, router_share=share)
            loss.backward()
            load = st.pop(LOAD, None)
            if load is not None and real:
                tally.add_load(load)
            tally.add(float(loss.detach()), st, float(mb.response_mask.sum()))

    def _accumulate_pipelined(self, mini: TrainBatch, tally: _Tally, template: TrainBatch) -> None:
        """The mini-batch through the pipeline's schedule in equal micro-batches (relayrl.trainer.pipelined): each
        micro-batch's loss on the last stage is its share of the mini-batch loss (global denominators), and the
        schedule's backward accumulates the same gradient as micro-batches on one process."""
        counts = torch.tensor([float(mini.response_mask.sum()), float(len(mini))])
        if self.dp_group is not None:
            dist.all_reduce(counts, group=self.dp_group)
        num_tokens, num_seqs = counts[0].clamp(min=1), float(counts[1])
        m, per, length = micro_batches(mini, self.cfg.micro_batch_size, self.dp_group, self.pipe)
        rows = pad_rows(mini, m, per, length, template).to(self.device)
        done: dict[int, tuple[float, dict, float]] = {}  # by first row: torch's shape inference runs one twice

        def objective(idx: torch.Tensor, logp: torch.Tensor, ent: torch.Tensor | None):
            mb = rows.select(idx)
            loss, stats = self._objective(mb, logp, ent, num_tokens, num_seqs)
            done[int(idx[0])] = (float(loss.detach()), stats, float(mb.response_mask.sum()))
            return loss, stats

        loss_fn = TokenLoss(rows.input_ids, objective, temperature=self.temperature, with_entropy=True,
                            tp_group=self.tp_group, entropy_grad=self.algo.entropy_coef != 0)
        with self._autocast():
            self.pipe.step(rows.input_ids, loss_fn, m, attention_mask=rows.attention_mask)
        tally.loss_steps += 1
        for loss, stats, tokens in done.values():
            tally.add(loss, stats, tokens)

    def loss(self, mb: TrainBatch, num_tokens: torch.Tensor, num_seqs: float,
             router_share: float | None = None) -> tuple[torch.Tensor, dict]:
        """One micro-batch's share of the mini-batch loss (global denominators) and its stats. router_share (MoE):
        its part of the mini-batch's real tokens, which weights its routers' auxiliary losses (None: 1, the
        micro-batch is the mini-batch)."""
        routing = replay_routing(mb.routing, self.algo.routing_replay, keep_record=self.moe is not None)
        with self._autocast():
            # entropy is reported every step; it carries gradient (and a graph) only when entropy_coef != 0
            logp, ent = token_logprobs(self.model, mb.input_ids, mb.attention_mask, self.temperature,
                                       with_entropy=True, padding_free=self.cfg.padding_free,
                                       tp_group=self.tp_group, entropy_grad=self.algo.entropy_coef != 0,
                                       prefix_lens=self._prefix_lens(mb), routing=routing, cp=self.cp)
        loss, stats = self._objective(mb, logp, ent, num_tokens, num_seqs)
        if routing is not None:
            share = 1.0 if router_share is None else router_share
            loss, stats = self._router_terms(mb, routing, loss, stats, share, float(num_tokens))
        return loss, stats

    def _objective(self, mb: TrainBatch, logp: torch.Tensor, ent: torch.Tensor | None, num_tokens: torch.Tensor,
                   num_seqs: float) -> tuple[torch.Tensor, dict]:
        """The policy objective of a micro-batch's logprobs: its share of the mini-batch loss, and its stats."""
        # no old_logp: this is the batch's only optimiser step (the driver's "update" source), so the proximal
        # policy is these very weights: its logprobs are this forward's, detached
        old = mb.old_logp if mb.old_logp is not None else logp.detach()
        loss, stats = policy_objective(
            logp, old, mb.advantages, mb.response_mask, self.algo,
            rollout_logp=mb.rollout_logp, ref_logp=mb.ref_logp, entropy=ent,
            num_tokens=num_tokens, num_seqs=num_seqs,
        )
        if mb.old_logp is None and mb.rollout_logp is not None:  # the trainer-engine gap, from the same numbers
            stats |= mismatch_stats(old, mb.rollout_logp, mb.response_mask)
        return loss, stats

    def _router_terms(self, mb: TrainBatch, routing, loss: torch.Tensor, stats: dict, share: float,
                      num_tokens: float) -> tuple[torch.Tensor, dict]:
        """MoE: the routers' auxiliary losses added (algo.moe_*_coef), moe/routing_mismatch against the engine's
        record, and the micro-batch's expert load (stats[LOAD], summed by the tally)."""
        k, a = self.moe.num_experts_per_tok, self.algo
        aux, aux_stats = router_losses(routing, mb.attention_mask, k, a.moe_aux_loss_coef, a.moe_z_loss_coef, share)
        # the tally weights a stat by the micro-batch's response tokens; the router terms weigh by real tokens
        # (share), so each is scaled to come out as the mini-batch's value (moe/z_loss exactly: a mean over tokens)
        tokens = float(mb.response_mask.sum())
        scale = share * num_tokens / tokens if tokens > 0 else 0.0
        stats |= {key: v * scale for key, v in aux_stats.items()}
        if mb.routing is not None:
            stats["moe/routing_mismatch"] = routing_mismatch(routing, mb.routing, mb.response_mask, k)
        stats[LOAD] = routed_load(routing, mb.attention_mask, self.moe.num_experts)
        return (loss + aux if a.moe_aux_loss_coef or a.moe_z_loss_coef else loss), stats


LOAD = "moe/_load"  # a micro-batch's expert load [n_moe, E] in the loss' stats, for the tally (not a metric)


class _Tally:
    """Stats of an update, exact under micro-batching and data parallelism:

    per-token stats (clip_frac, entropy, kl, ...) are token means of each micro-batch, so they are
    summed weighted by tokens and divided by the total; `loss` is summed (each micro-batch's loss
    is its share of the mini-batch loss, each rank's its share of the global one) and averaged over
    optimiser steps; ratio_max (every *_max) is a max; grad_norm, already global, is averaged over steps."""

    def __init__(self, moe=None):
        self.weighted: dict[str, float] = defaultdict(float)
        self.maxima: dict[str, float] = {"ratio_max": 0.0}  # every stat named *_max is a max, not a mean
        self.tokens = self.loss = 0.0
        self.step_loss = 0.0  # this rank's loss of the optimiser step in progress (Actor.step_on resets it)
        self.loss_steps = 0
        self.grad_norms: list[float] = []
        # MoE (an MoEShape): routed slots per (MoE layer, expert), summed; zeros on a rank with no real rows, so
        # every rank takes part in its all-reduce
        self.moe_layers = moe.moe_layers if moe is not None else ()
        self.load = torch.zeros(len(moe.moe_layers), moe.num_experts, dtype=torch.float64) if moe is not None else None

    def add_load(self, load: torch.Tensor) -> None:
        self.load += load.detach().double().cpu()

    def add(self, loss: float, stats: dict, tokens: float) -> None:
        self.loss += loss
        self.step_loss += loss
        self.tokens += tokens
        for k, v in stats.items():
            if k.endswith("_max"):
                self.maxima[k] = max(self.maxima.get(k, 0.0), float(v))
            else:
                self.weighted[k] += float(v) * tokens

    def all_reduce(self, group) -> None:
        keys, peaks = sorted(self.weighted), sorted(self.maxima)
        sums = torch.tensor([self.tokens, self.loss] + [self.weighted[k] for k in keys], dtype=torch.float64)
        peak = torch.tensor([self.maxima[k] for k in peaks], dtype=torch.float64)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        self.tokens, self.loss = float(sums[0]), float(sums[1])
        self.weighted = {k: float(v) for k, v in zip(keys, sums[2:], strict=True)}
        self.maxima = {k: float(v) for k, v in zip(peaks, peak, strict=True)}
        if self.load is not None:
            dist.all_reduce(self.load, group=group)

    def result(self) -> dict[str, float]:
        out = {k: v / max(self.tokens, 1.0) for k, v in self.weighted.items()}
        out["loss"] = self.loss / max(self.loss_steps, 1)
        out |= self.maxima
        if self.grad_norms:
            out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        if self.load is not None:
            out |= load_metrics(self.load, self.moe_layers)
        return out
