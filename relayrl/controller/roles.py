"""The trainer-side roles as worker-group workers, and the one interface the driver sees.

    driver ──Policy──> LocalPolicy   the actor (and reference) in the driver's own process
                   └─> GroupPolicy   an ActorWorker group (+ ReferenceWorker group), SPMD inside:
                                     DP_SPLIT rows to data-parallel ranks, FSDP / DDP / TP per
                                     `parallel.*`, local processes or Ray

Both take and return the same TrainBatch tensors, so the driver code is one. Placement: the
reference model shares the actor's pool (colocated, `parallel.placement: colocated`) or gets a pool
of its own (`disaggregated`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from relayrl.checkpoint import load_distributed, save_distributed
from relayrl.config import Config
from relayrl.controller.batch import DataBatch
from relayrl.controller.dispatch import Dispatch, dispatch
from relayrl.controller.worker import Worker, dp_info_from_dims
from relayrl.models import load_pretrained
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import parallelize_model
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.logprobs import token_logprobs
from relayrl.trainer.optim import foreach_ok

FIELDS = ("input_ids", "attention_mask", "response_mask", "advantages", "old_logp", "rollout_logp", "ref_logp")


class ParallelConfig(Config):
    """How the trainer runs: in the driver's process, or as a worker group of dp x tp ranks."""

    backend: Literal["none", "local", "ray"] = "none"  # none: one process, the driver's own
    dp_replicate: int = Field(1, ge=1)
    dp_shard: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    dp_mode: Literal["fsdp", "ddp"] = "fsdp"
    activation_checkpointing: bool = False
    placement: Literal["colocated", "disaggregated"] = "colocated"  # where the reference model runs
    rollout_worker: bool = False  # the engine in a worker group of its own instead of the driver
    reward_workers: int = Field(0, ge=0)  # score in N reward workers (0: in the driver)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp


def to_data(batch: TrainBatch) -> DataBatch:
    return DataBatch({k: getattr(batch, k) for k in FIELDS if getattr(batch, k) is not None})


def to_train(batch: DataBatch) -> TrainBatch:
    return TrainBatch(**{k: batch.tensors.get(k) for k in FIELDS})


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


class _ParallelModelWorker(Worker):
    def _build_model(self, model_dir: str, par: ParallelConfig, seed: int, trains: bool = True):
        self.init_distributed()
        torch.manual_seed(seed)
        self.dims = ParallelDims(dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, tp=par.tp,
                                 world_size=self.world_size)
        mesh = self.dims.build_mesh(self.device.split(":")[0])
        model = load_pretrained(model_dir)
        if not trains and par.dp_mode == "ddp":
            return model  # DDP only syncs gradients: a frozen model is simply replicated
        return parallelize_model(model, self.dims, mesh, dp_mode=par.dp_mode,
                                 activation_checkpointing=par.activation_checkpointing and trains)

    def dp_info(self):
        return dp_info_from_dims(self.rank, self.dims)


class ActorWorker(_ParallelModelWorker):
    def __init__(self, model_dir: str, par: ParallelConfig, trainer_cfg, algo_cfg, total_steps: int,
                 temperature: float, seed: int):
        model = self._build_model(model_dir, par, seed)
        self.actor = Actor(model, trainer_cfg, algo_cfg, total_steps, temperature, seed, dims=self.dims)

    @dispatch(Dispatch.DP_SPLIT)
    def compute_logprobs(self, batch: DataBatch) -> DataBatch:
        return DataBatch({"old_logp": self.actor.compute_logprobs(to_train(batch))})

    @dispatch(Dispatch.DP_SPLIT)
    def update(self, batch: DataBatch) -> dict:
        return self.actor.update(to_train(batch))  # stats already reduced over data-parallel ranks

    @dispatch(Dispatch.RANK_ZERO)
    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter as one full tensor (a gather: the planned shard-to-shard sync replaces it)."""
        return {n: _full(p) for n, p in self.actor.model.state_dict().items()}

    @dispatch(Dispatch.RANK_ZERO)
    def save(self, run_dir: str, step: int, extra: dict, meta: dict, keep_last: int | None) -> str:
        """Every rank writes its shard (collective); rank 0 adds `extra` and renames when complete."""
        return str(save_actor(self.actor, run_dir, step, extra, meta, keep_last))

    @dispatch(Dispatch.RANK_ZERO)
    def load(self, path: str) -> dict:
        return load_actor(self.actor, path)

    def teardown(self) -> None:
        del self.actor


class ReferenceWorker(_ParallelModelWorker):
    def __init__(self, model_dir: str, par: ParallelConfig, temperature: float, micro_batch_size: int, seed: int):
        self.model = self._build_model(model_dir, par, seed, trains=False).eval().requires_grad_(False)
        self.temperature, self.micro = temperature, micro_batch_size
        self.tp_group = self.dims.tp_mesh.get_group() if self.dims.tp > 1 else None

    @dispatch(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def compute_ref_logprobs(self, batch: DataBatch) -> DataBatch:
        tb = to_train(batch)
        parts = [token_logprobs(self.model, mb.input_ids, mb.attention_mask, self.temperature,
                                tp_group=self.tp_group)[0] * mb.response_mask for mb in tb.split(self.micro)]
        return DataBatch({"ref_logp": torch.cat(parts)})

    def teardown(self) -> None:
        del self.model


def save_actor(actor: Actor, run_dir, step: int, extra: dict, meta: dict, keep_last: int | None):
    """One checkpoint format for every layout (torch.distributed.checkpoint shards), so a run saved
    on N ranks resumes on M, or in one process."""
    extra = {**extra, "scheduler": actor.scheduler.state_dict(), "shuffle": actor.shuffle_gen.get_state()}
    return save_distributed(run_dir, step, actor.model, actor.optimizer, extra, meta=meta, keep_last=keep_last)


def load_actor(actor: Actor, path) -> dict:
    extra = load_distributed(path, actor.model, actor.optimizer)
    for group in actor.optimizer.param_groups:  # the saved layout's choice does not fit this one
        group["foreach"] = foreach_ok(group["params"])
    actor.scheduler.load_state_dict(extra["scheduler"])  # after the optimizer: its lr wins
    actor.shuffle_gen.set_state(extra["shuffle"])
    return extra


class LocalPolicy:
    """The actor (and reference model) in the driver's process."""

    def __init__(self, actor: Actor, ref_model=None, temperature: float = 1.0, micro_batch_size: int = 32):
        self.actor, self.ref_model = actor, ref_model
        self.temperature, self.micro = temperature, micro_batch_size

    def weights(self):
        return self.actor.model.state_dict().items()

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.actor.compute_logprobs(batch)

    @torch.no_grad()
    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        if self.ref_model is None:
            return None
        return torch.cat([token_logprobs(self.ref_model, mb.input_ids, mb.attention_mask, self.temperature)[0]
                          * mb.response_mask for mb in batch.split(self.micro)])

    def update(self, batch: TrainBatch) -> dict[str, float]:
        return self.actor.update(batch)

    def save(self, run_dir, step: int, extra: dict, meta: dict, keep_last: int | None) -> Path:
        return save_actor(self.actor, run_dir, step, extra, meta, keep_last)

    def load(self, path) -> dict:
        return load_actor(self.actor, path)

    def close(self) -> None:
        pass


class GroupPolicy:
    """The actor (and reference) as worker groups; same methods as LocalPolicy."""

    def __init__(self, model_dir: Path, par: ParallelConfig, trainer_cfg, algo_cfg, total_steps: int,
                 temperature: float, seed: int, with_reference: bool):
        from relayrl.controller.resource_pool import ResourcePool
        from relayrl.controller.worker_group import spawn_roles

        pool = ResourcePool([par.world_size], name="actor")
        placement = {"actor": pool}
        roles = {"actor": (ActorWorker, (str(model_dir), par, trainer_cfg, algo_cfg, total_steps, temperature, seed))}
        if with_reference:
            # colocated: one group whose processes host both roles; disaggregated: a pool of its own
            placement["reference"] = pool if par.placement == "colocated" else ResourcePool([par.world_size], name="ref")
            roles["reference"] = (ReferenceWorker, (str(model_dir), par, temperature, trainer_cfg.micro_batch_size, seed))
        self.roles = spawn_roles(placement, roles, backend=par.backend)
        self.actor = self.roles["actor"]
        self.ref = self.roles["reference"] if with_reference else None

    def weights(self):
        return self.actor.full_weights().items()

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.actor.compute_logprobs(to_data(batch))["old_logp"]

    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        return None if self.ref is None else self.ref.compute_ref_logprobs(to_data(batch))["ref_logp"]

    def update(self, batch: TrainBatch) -> dict[str, float]:
        return self.actor.update(to_data(batch))[0]  # one (identical) dict per data-parallel rank

    def save(self, run_dir, step: int, extra: dict, meta: dict, keep_last: int | None) -> Path:
        return Path(self.actor.save(str(run_dir), step, extra, meta, keep_last))

    def load(self, path) -> dict:
        return self.actor.load(str(path))

    def close(self) -> None:
        self.roles.shutdown()
