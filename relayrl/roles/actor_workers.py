"""This module defines the trainer-side roles as worker-group workers: the actor, the reference model and the
critic.

    ActorWorker       one rank of the actor: its (FSDP / DDP / TP) model, optimizer and schedule;
                      compute_logprobs and update split over data-parallel ranks; checkpoints;
                      run_on_rank(fn) for the weight sync; colocated, `engine_runner` is the engine rank
                      beside it in its process (relayrl.roles.group_policy.TrainerProcess sets it)
    ReferenceWorker   one rank of the frozen reference model: compute_ref_logprobs (with trainer.lora
                      none is built: ActorWorker.compute_ref_logprobs runs the actor's base, adapters off)
    CriticWorker      one rank of PPO's value model (laid out like the actor): compute_values, update,
                      checkpoints beside the actor's

All build their model the same way (load, then parallelize_model by `parallel.*`; with parallel.pp > 1 the
model is first cut into this rank's pipeline stages, each parallelized, and `model` is their merge under the full
model's names, run through `pipe`). A world of 1 in an inline group (`parallel.backend: none`, the driver's own
process) joins no process group and builds no mesh: its model is whole on its device (`_whole_model`). A DP_SPLIT
method takes the TrainBatch itself (it is a single_controller Rows: chunked by dp rank, pickled compactly; inline,
the same tensors) and answers a DataBatch of what it computed.

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the
jobs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from relayrl.engine.model_runner import ModelRunner
from relayrl.errors import ModelDirError
from relayrl.models import load_pretrained
from relayrl.models.lora import apply_lora_config
from relayrl.models.score import ScoreModel, from_causal_lm, load_score_model
from relayrl.models.stage import merge_stages, split_model
from relayrl.observe.comm_profile import COMM_SHARE, COMM_TIME, CommProfile
from relayrl.observe.device_memory import device_memory_metrics
from relayrl.parallel.config import ParallelConfig
from relayrl.parallel.context_parallel import apply_context_parallel
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import apply_activation_checkpointing, parallelize_model
from relayrl.parallel.pipeline import Pipeline, rank_stages
from relayrl.single_controller.batch import DataBatch
from relayrl.single_controller.dispatch import Dispatch, DPInfo, dispatch
from relayrl.single_controller.worker import Worker, dp_info_from_dims
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.checkpointing import load_actor, load_critic, save_actor, save_critic
from relayrl.trainer.config import CriticConfig
from relayrl.trainer.critic import Critic
from relayrl.trainer.reference import Reference


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A parameter as one full CPU tensor (gathering a DTensor's shards)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def actor_model(model_dir: str | Callable[[], torch.nn.Module], lora, seed: int) -> torch.nn.Module:
    """The policy at model_dir (or what a function made in memory builds); with `trainer.lora` (a LoRAConfig), its
    base frozen (in lora.base_dtype) and low-rank adapters on the target linears, seeded alike on every rank —
    before any parallelism is applied."""
    model = model_dir() if callable(model_dir) else load_pretrained(model_dir)
    return model if lora is None else apply_lora_config(model, lora, seed=seed)


def critic_model(model_dir: str, cfg: CriticConfig, seed: int) -> ScoreModel:
    """The value model: critic.path's classifier, or the policy at model_dir with a fresh one-label head."""
    if cfg.path is not None:
        model = load_score_model(cfg.path)
        if model.num_labels != 1:
            raise ModelDirError(f"critic.path={cfg.path}: a value model has one label, this one has {model.num_labels}")
        return model
    return from_causal_lm(model_dir, head_std=cfg.head_std, seed=seed)


def _gather_objects(mine: dict, group, size: int) -> dict:
    """The union of every group rank's dict (all_gather_object; each rank's keys its own)."""
    import torch.distributed as dist

    parts: list = [None] * size
    dist.all_gather_object(parts, mine, group=group)
    out: dict = {}
    for part in parts:
        out.update(part)
    return out


class _ParallelModelWorker(Worker):
    def _build_model(self, model_dir: str, par: ParallelConfig, seed: int, trains: bool = True, loader=None):
        alone = self.world_size == 1 and not self.in_group  # inline in the driver's process: no group to join
        if not alone:
            self.init_distributed()
        self.cp = None  # the ContextParallel wrapper when dims.cp > 1 (below)
        self.pipe = None  # the Pipeline over this rank's stages when dims.pp > 1 (below)
        torch.manual_seed(seed)
        self.dims = ParallelDims(pp=par.pp, dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, cp=par.cp,
                                 tp=par.tp, ep=par.ep, world_size=self.world_size)
        model = loader() if loader is not None else load_pretrained(model_dir)
        if alone:
            return self._whole_model(model, par, trains)
        mesh = self.dims.build_mesh(self.device.split(":")[0])
        # on this worker's device before the optimiser is built. FSDP2 (parallelize_model's data-parallel step
        # with dp_mode fsdp over more than one rank) moves each block to the mesh's device as it shards it, so a
        # sharded model is never whole on one GPU; any other model goes over whole, before TP / DDP
        sharded = par.dp_mode == "fsdp" and self.dims.dp * self.dims.cp > 1
        # pipeline: only this rank's stages are kept (the other layers are dropped with the full model)
        parts = split_model(model, *rank_stages(self.dims, par.pp_schedule)) if par.pp > 1 else [model]
        del model
        if not sharded:
            parts = [m.to(self.device) for m in parts]
        if not trains and par.dp_mode == "ddp" and par.pp == 1:
            return parts[0]  # DDP only syncs gradients: a frozen model is simply replicated
        for m in parts:
            if parallelize_model(m, self.dims, mesh, dp_mode=par.dp_mode,
                                 activation_checkpointing=par.activation_checkpointing and trains) is not m:
                raise RuntimeError("parallelize_model wrapped the model (DDP over dp ranks): relayrl.roles."
                                   "actor_workers needs it in place; use dp_mode fsdp")
        if par.pp > 1:
            self.pipe = Pipeline(parts, self.dims, par.pp_schedule)
        model = merge_stages(parts) if par.pp > 1 else parts[0]
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != mesh.device_type]
        if left:
            raise RuntimeError(f"after parallelize_model, {len(left)} tensors are not on {self.device} "
                               f"(first: {left[0]}): relayrl.roles.actor_workers expected FSDP to move them")
        # context parallelism swaps each attention's computation; forwards then go through self.cp
        self.cp = (apply_context_parallel(model, self.dims.cp_mesh.get_group(), par.cp_mode) if self.dims.cp > 1
                   else None)
        return model

    def _whole_model(self, model: torch.nn.Module, par: ParallelConfig, trains: bool) -> torch.nn.Module:
        """A world of 1 in the driver's process (parallel.backend none): nothing to shard, so no process group, no
        mesh and no parallelize_model; the whole model on this device (checkpointed when asked)."""
        model = model.to(self.device)
        if par.activation_checkpointing and trains:
            apply_activation_checkpointing(model)
        return model

    def dp_info(self) -> DPInfo:
        return dp_info_from_dims(self.rank, self.dims)


class ActorWorker(_ParallelModelWorker):
    """One actor rank; also a relayrl.trainer.policy.TrainerRank (rank, model, engine_runner, sync_state)."""

    def __init__(self, model_dir: str, par: ParallelConfig, trainer_cfg, algo_cfg, *, total_steps: int,
                 temperature: float, seed: int):
        model = self._build_model(model_dir, par, seed, loader=lambda: actor_model(model_dir, trainer_cfg.lora, seed))
        self.actor = Actor(model, trainer_cfg, algo_cfg, total_steps=total_steps, temperature=temperature, seed=seed,
                           dims=self.dims, cp=self.cp, pipe=self.pipe)
        self.engine_runner: ModelRunner | None = None
        self.sync_state: dict[str, Any] = {}

    @property
    def model(self) -> torch.nn.Module:
        return self.actor.model

    @dispatch(Dispatch.ONE_TO_ALL)
    def run_on_rank(self, fn, args: tuple) -> Any:
        """fn(self, *args): how the weight sync acts on this rank's shards (relayrl.roles.sync_steps)."""
        return fn(self, *args)

    # ---- the RL step ----
    @dispatch(Dispatch.DP_SPLIT)
    def compute_logprobs(self, batch: TrainBatch) -> DataBatch:
        return DataBatch({"old_logp": self.actor.compute_logprobs(batch)})

    @dispatch(Dispatch.DP_SPLIT)
    def compute_ref_logprobs(self, batch: TrainBatch) -> DataBatch:
        """trainer.lora: the reference is this actor's frozen base (adapters off); no ReferenceWorker is built."""
        return DataBatch({"ref_logp": self.actor.compute_ref_logprobs(batch)})

    @dispatch(Dispatch.DP_SPLIT)
    def update(self, batch: TrainBatch, profile: bool = False) -> dict:
        # a world of 1 runs no collectives: a profiled step's time/update_comm is 0 without running torch.profiler,
        # whose event parsing alone took seconds per profiled step (10% of the demo's update time on average)
        alone = self.world_size == 1
        with CommProfile(profile and self.rank == 0 and not alone) as comm:  # rank 0's (GroupPolicy returns its dict)
            stats = self.actor.update(batch)  # stats already reduced over data-parallel ranks
        comm_stats = {COMM_TIME: 0.0, COMM_SHARE: 0.0} if profile and alone else comm.metrics()
        return stats | comm_stats | device_memory_metrics(self.device)  # CUDA: memory/* (rank 0's reported)

    @dispatch(Dispatch.RANK_ZERO)
    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter as one full tensor: for exporting the final model and for the vLLM
        backend, whose loader takes full tensors. The rollout engine is synced by the plan. Under pipeline
        parallelism each pp rank holds other layers, under expert parallelism each ep rank other experts: rank 0
        gathers theirs from its pipeline and its ep group. (A tied model's lm_head copy is its embedding's.)"""
        if not self.in_group:  # inline (the driver's process): the tensors themselves, where they live, no copy
            return {n: p.detach() for n, p in self.actor.model.state_dict().items()}
        weights = {n: full_tensor(p) for n, p in self.actor.model.state_dict().items()}
        if self.dims.pp > 1:  # each pp rank holds its stages' tensors: gathered over this rank's pipeline
            weights = _gather_objects(weights, self.dims.pp_mesh.get_group(), self.dims.pp)
        if self.dims.ep > 1:
            mine = {n: t for n, t in weights.items() if ".experts." in n}
            weights.update(_gather_objects(mine, self.dims.ep_mesh.get_group(), self.dims.ep))
        return weights

    @dispatch(Dispatch.RANK_ZERO)
    def save(self, run_dir: str, step: int, extra: dict, meta: dict, keep_last: int | None) -> str:
        """Every rank writes its shard (collective); rank 0 adds the run state and renames when complete."""
        return str(save_actor(self.actor, run_dir, step, extra=extra, meta=meta, keep_last=keep_last))

    @dispatch(Dispatch.RANK_ZERO)
    def load(self, path: str) -> dict:
        return load_actor(self.actor, path)

    def teardown(self) -> None:
        del self.actor
        self.engine_runner = None
        self.sync_state.clear()


class CriticWorker(_ParallelModelWorker):
    """One rank of the critic (PPO's value model), laid out like the actor."""

    def __init__(self, model_dir: str, par: ParallelConfig, critic_cfg: CriticConfig, algo_cfg, *, total_steps: int,
                 seed: int):
        model = self._build_model(model_dir, par, seed, loader=lambda: critic_model(model_dir, critic_cfg, seed))
        self.critic = Critic(model, critic_cfg, algo_cfg, total_steps=total_steps, seed=seed, dims=self.dims)

    @dispatch(Dispatch.DP_SPLIT)
    def compute_values(self, batch: TrainBatch) -> DataBatch:
        return DataBatch({"values": self.critic.compute_values(batch)})

    @dispatch(Dispatch.DP_SPLIT)
    def update(self, batch: TrainBatch) -> dict:
        return self.critic.update(batch)

    @dispatch(Dispatch.RANK_ZERO)
    def save(self, run_dir: str, step: int, meta: dict, keep_last: int | None) -> str:
        return str(save_critic(self.critic, run_dir, step, meta=meta, keep_last=keep_last))

    @dispatch(Dispatch.RANK_ZERO)
    def load(self, actor_checkpoint: str) -> None:
        load_critic(self.critic, actor_checkpoint)

    def teardown(self) -> None:
        del self.critic


class ReferenceWorker(_ParallelModelWorker):
    def __init__(self, model_dir: str, par: ParallelConfig, *, temperature: float, micro_batch_size: int,
                 seed: int, padding_free: bool = False, shared_prefix: bool = False, routing_replay: bool = False):
        model = self._build_model(model_dir, par, seed, trains=False)
        self.reference = Reference(model, temperature=temperature, micro_batch_size=micro_batch_size,
                                   padding_free=padding_free, shared_prefix=shared_prefix,
                                   routing_replay=routing_replay, dims=self.dims, cp=self.cp, pipe=self.pipe,
                                   device=self.device)

    @dispatch(Dispatch.DP_SPLIT)
    def compute_ref_logprobs(self, batch: TrainBatch) -> DataBatch:
        # the logprobs come back on the batch's device (the host's, to travel; inline, where the rows came from)
        return DataBatch({"ref_logp": self.reference.compute_ref_logprobs(batch)})

    def teardown(self) -> None:
        del self.reference
