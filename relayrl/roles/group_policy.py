"""GroupPolicy runs the trainer as worker groups (the actor group, and the reference model's), SPMD inside,
behind the Policy protocol (relayrl.trainer.policy): on local processes or Ray, or inline in the driver's own
process (`parallel.backend: none`: a world of 1, the same workers, no process group, nothing copied).

    driver ── GroupPolicy ──> actor group: ActorWorker x (dp_replicate x dp_shard x tp)
                          └─> reference: ReferenceWorker, in the actor's processes (placement
                              colocated: one ColocatedWorker per process) or a pool of its own;
                              with trainer.lora none: the actor's base (adapters off) is the reference
                          └─> critic: CriticWorker (PPO's value model), placed like the reference
                          └─> engine: the colocated rollout engine's ranks (colocated_engine, a RoleSpec of
                              relayrl.engine.tp_workers.RunnerWorker) in the actor's processes; the run's
                              builder hands `roles["engine"]` to the engine (relayrl.jobs.build)

Roles sharing the actor's processes are hosted by a TrainerProcess (a ColocatedWorker), which also gives each
actor rank its sibling engine rank's runner (`engine_runner`: what the weight sync copies into in place).

Every call is declared at the worker (relayrl.roles.actor_workers) and called here by the
method itself, so a reader goes from the driver's call to its definition. `group_options` turns the
run's `parallel.*` settings into the groups' deadlines and heartbeat timeout.

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the
jobs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from relayrl.parallel.config import ParallelConfig
from relayrl.parallel.device import resolve_device
from relayrl.roles.actor_workers import ActorWorker, CriticWorker, ReferenceWorker
from relayrl.single_controller.liveness import Deadlines, GroupOptions
from relayrl.single_controller.placement import spawn_roles
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import ColocatedWorker, RoleSpec
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.config import CriticConfig


def group_options(par: ParallelConfig, trace_dir: str | None = None) -> GroupOptions:
    """The worker groups' options from the run's `parallel:` section, and where their workers trace (None: off)."""
    t = par.call_timeout_s
    return GroupOptions(backend=par.backend, heartbeat_timeout_s=par.heartbeat_timeout_s, trace_dir=trace_dir,
                        deadlines=Deadlines(build=t.build, compute=t.compute, control=t.control, close=t.close))


class TrainerProcess(ColocatedWorker):
    """The roles of one trainer process; its actor rank reaches the engine rank beside it (if any)."""

    def __init__(self, roles: dict):
        super().__init__(roles)
        if "actor" in roles and "engine" in roles:
            self.actor.engine_runner = self.engine.runner


class GroupPolicy:
    """The actor (and reference, critic) as worker groups."""

    def __init__(self, model_dir: str | Path | Callable[[], nn.Module], *, par: ParallelConfig, trainer_cfg,
                 algo_cfg, total_steps: int, temperature: float = 1.0, seed: int = 0, with_reference: bool = False,
                 critic_cfg: CriticConfig | None = None, options: GroupOptions | None = None,
                 colocated_engine: RoleSpec | None = None):
        """model_dir: the policy's directory, or a function that builds it (a model made in memory: inline, or
        picklable by name for worker processes; the reference and critic load from a directory).
        colocated_engine: the engine's rank role, placed in the actor's processes as `roles["engine"]`.
        options: the groups' (group_options(par) when None); parallel.backend none runs them inline."""
        options = options or group_options(par)
        self.inline = par.backend == "none"  # the driver's process is the world of 1
        if self.inline:
            options = dataclasses.replace(options, backend="inline")
        actor_src = model_dir if callable(model_dir) else str(model_dir)
        device = resolve_device(par.device)  # worker r computes on <device>:r (cpu: every one on the host)
        pool = ResourcePool([par.world_size], device=device, name="actor")
        placement = {"actor": pool}
        roles = {"actor": RoleSpec(ActorWorker, (actor_src, par, trainer_cfg, algo_cfg),
                                   dict(total_steps=total_steps, temperature=temperature, seed=seed))}
        # trainer.lora: the reference is the actor's frozen base, its logprobs the actor's with adapters off
        self.ref_in_actor = with_reference and trainer_cfg.lora is not None
        if (with_reference and not self.ref_in_actor or critic_cfg is not None) and callable(model_dir):
            raise ValueError("the reference model and the critic load from a directory; pass model_dir as one")
        if with_reference and not self.ref_in_actor:
            # colocated: one group whose processes host both roles; disaggregated: a pool of its own
            placement["reference"] = (pool if par.placement == "colocated"
                                      else ResourcePool([par.world_size], device=device, name="reference"))
            roles["reference"] = RoleSpec(ReferenceWorker, (str(model_dir), par),
                                          dict(temperature=temperature, micro_batch_size=trainer_cfg.micro_batch_size,
                                               seed=seed, padding_free=trainer_cfg.padding_free,
                                               shared_prefix=trainer_cfg.shares_prefix,
                                               routing_replay=algo_cfg.routing_replay))
        if critic_cfg is not None:  # laid out like the actor: in its processes, or a pool of its own
            placement["critic"] = (pool if par.placement == "colocated"
                                   else ResourcePool([par.world_size], device=device, name="critic"))
            roles["critic"] = RoleSpec(CriticWorker, (str(model_dir), par, critic_cfg, algo_cfg),
                                       dict(total_steps=total_steps, seed=seed))
        if colocated_engine is not None:
            placement["engine"], roles["engine"] = pool, colocated_engine
        self.roles = spawn_roles(placement, roles, options=options, colocated_cls=TrainerProcess)
        self.actor = self.roles["actor"]
        self.ref = self.roles["reference"] if "reference" in roles else None
        self.critic = self.roles["critic"] if critic_cfg is not None else None
        self.address = self.actor.master_addr  # where the workers reach the driver (the sync's rendezvous)

    def run_on_ranks(self, fn: Callable, *args) -> list:
        return self.actor.call(ActorWorker.run_on_rank, fn, args)

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.actor.call(ActorWorker.full_weights).items()

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.actor.call(ActorWorker.compute_logprobs, batch)["old_logp"]

    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        if self.ref_in_actor:
            return self.actor.call(ActorWorker.compute_ref_logprobs, batch)["ref_logp"]
        if self.ref is None:
            return None
        return self.ref.call(ReferenceWorker.compute_ref_logprobs, batch)["ref_logp"]

    def update(self, batch: TrainBatch, *, profile: bool = False) -> dict[str, float]:
        # one dict per dp rank, identical but for rank 0's profile
        return self.actor.call(ActorWorker.update, batch, profile=profile)[0]

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        return self.critic.call(CriticWorker.compute_values, batch)["values"]

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        return self.critic.call(CriticWorker.update, batch)[0]

    def save(self, run_dir: str | Path, step: int, *, extra: Mapping[str, Any], meta: Mapping[str, Any],
             keep_last: int | None) -> Path:
        if self.critic is not None:  # first: a complete actor checkpoint implies its critic's
            self.critic.call(CriticWorker.save, str(run_dir), step, dict(meta), keep_last)
        return Path(self.actor.call(ActorWorker.save, str(run_dir), step, dict(extra), dict(meta), keep_last))

    def load(self, path: str | Path) -> dict[str, Any]:
        extra = self.actor.call(ActorWorker.load, str(path))
        if self.critic is not None:
            self.critic.call(CriticWorker.load, str(path))
        return extra

    def close(self) -> None:
        self.roles.shutdown(raise_errors=False)
