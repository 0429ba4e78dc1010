"""LocalPolicy runs the trainer (actor, reference model, and PPO's critic) in the driver's own process
(`parallel.backend: none`), behind the same Policy protocol as the worker groups (relayrl.trainer.policy).

The driver's process is trainer rank 0 of 1. Colocated, the engine's one rank lives here too:
`host_engine` builds its ModelRunner beside the actor, so the weight sync copies every piece in place.

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the
jobs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from relayrl.engine.model_runner import ModelRunner
from relayrl.engine.parallel_state import TPInfo
from relayrl.engine.runner_groups import InProcessRunner
from relayrl.models.config import ModelConfig
from relayrl.observe.comm_profile import COMM_SHARE, COMM_TIME
from relayrl.observe.device_memory import device_memory_metrics
from relayrl.parallel.rendezvous import LOCALHOST
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.checkpointing import load_actor, load_critic, save_actor, save_critic
from relayrl.trainer.critic import Critic
from relayrl.trainer.reference import Reference


class LocalRank:
    """The driver's process as trainer rank 0 (a relayrl.trainer.policy.TrainerRank)."""

    def __init__(self, model: nn.Module):
        self.rank, self.model = 0, model
        self.engine_runner: ModelRunner | None = None
        self.sync_state: dict[str, Any] = {}


class LocalPolicy:
    """The actor (and reference model) in the driver's process."""

    def __init__(self, actor: Actor, ref_model: nn.Module | None = None, *, temperature: float = 1.0,
                 micro_batch_size: int = 32, critic: Critic | None = None, ref_in_actor: bool = False):
        """ref_in_actor (trainer.lora): the reference is the actor's frozen base, and ref_model is None."""
        self.actor, self.ref_model, self.critic = actor, ref_model, critic
        self.ref_in_actor = ref_in_actor
        self.temperature, self.micro = temperature, micro_batch_size
        self.local = LocalRank(actor.model)
        self.address = LOCALHOST

    def host_engine(self, model_config: ModelConfig, dtype: torch.dtype, tp: int,
                    expert_placement: str = "tp") -> InProcessRunner:
        """Colocated: the engine's one rank beside the actor (LLMEngine(runner_group=...))."""
        if tp != 1:
            raise ValueError("a trainer in the driver's process hosts one engine rank (rollout.tp=1)")
        device = str(next(self.actor.model.parameters()).device)
        self.local.engine_runner = ModelRunner(model_config, dtype, TPInfo(), device, expert_placement)
        return InProcessRunner(self.local.engine_runner)

    def run_on_ranks(self, fn: Callable, *args) -> list:
        return [fn(self.local, *args)]

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.actor.model.state_dict().items()

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.actor.compute_logprobs(batch)

    @torch.no_grad()
    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        if self.ref_in_actor:
            return self.actor.compute_ref_logprobs(batch)
        if self.ref_model is None:
            return None
        cfg = self.actor.cfg
        logp = Reference(self.ref_model, temperature=self.temperature, micro_batch_size=self.micro,
                         padding_free=cfg.padding_free, shared_prefix=cfg.shares_prefix,
                         routing_replay=self.actor.algo.routing_replay).compute_ref_logprobs(batch)
        return logp.to(batch.response_mask.device)  # the reference's device (a GPU) and back

    def update(self, batch: TrainBatch, *, profile: bool = False) -> dict[str, float]:
        stats = self.actor.update(batch)
        # one process runs no collectives: a profiled step's time/update_comm is 0 without running torch.profiler,
        # whose event parsing alone took seconds per profiled step (10% of the demo's update time on average)
        comm = {COMM_TIME: 0.0, COMM_SHARE: 0.0} if profile else {}
        return stats | comm | device_memory_metrics(self.actor.device)  # CUDA: memory/*

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        return self.critic.compute_values(batch)

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        return self.critic.update(batch)

    def save(self, run_dir: str | Path, step: int, *, extra: Mapping[str, Any], meta: Mapping[str, Any],
             keep_last: int | None) -> Path:
        if self.critic is not None:  # first: a complete actor checkpoint implies its critic's
            save_critic(self.critic, run_dir, step, meta=meta, keep_last=keep_last)
        return save_actor(self.actor, run_dir, step, extra=extra, meta=meta, keep_last=keep_last)

    def load(self, path: str | Path) -> dict[str, Any]:
        extra = load_actor(self.actor, path)
        if self.critic is not None:
            load_critic(self.critic, path)
        return extra

    def close(self) -> None:
        self.local.engine_runner = None
        self.local.sync_state.clear()
