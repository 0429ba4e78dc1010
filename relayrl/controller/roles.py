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
from relayrl.controller.weight_sync import SyncStats, TrainerSide, merge
from relayrl.controller.worker import Worker, dp_info_from_dims
from relayrl.engine.llm_engine import available_memory
from relayrl.engine.model_runner import ModelRunner
from relayrl.engine.parallel_state import TPInfo
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
    # colocated: the rollout engine's ranks and the reference model run in the actor's processes
    # (engine rank r in actor rank r); disaggregated: each in processes of their own
    placement: Literal["colocated", "disaggregated"] = "colocated"
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
        self.sync_side, self.engine_runner = TrainerSide(), None

    # ---- the colocated engine: rank r of the engine's tensor-parallel group lives here (r < tp) ----
    @dispatch(Dispatch.ONE_TO_ALL)
    def init_engine(self, model_config, dtype: torch.dtype, tp: int) -> int | None:
        """Returns the free bytes of this rank's device (hosting ranks): the KV cache's budget base."""
        import torch.distributed as dist

        group = None
        if tp > 1:  # every rank takes part in making the group, members or not
            group = dist.group.WORLD if tp == self.world_size else dist.new_group(list(range(tp)))
        if self.rank < tp:
            self.engine_runner = ModelRunner(model_config, dtype, TPInfo(self.rank, tp, group), self.device)
            return available_memory(self.device)
        return None

    @dispatch(Dispatch.ONE_TO_ALL)
    def engine_call(self, method: str, args: tuple):
        return None if self.engine_runner is None else getattr(self.engine_runner, method)(*args)

    @dispatch(Dispatch.ONE_TO_ALL)
    def engine_run(self, fn, args: tuple):
        return None if self.engine_runner is None else fn(self.engine_runner, *args)

    # ---- weight sync (relayrl.controller.weight_sync) ----
    @dispatch(Dispatch.ONE_TO_ALL)
    def sync_connect(self, host: str, port: int, members, timeout_s: float) -> None:
        self.sync_side.connect(host, port, self.rank, members, timeout_s)

    @dispatch(Dispatch.ONE_TO_ALL)
    def sync_close(self) -> None:
        self.sync_side.close()

    @dispatch(Dispatch.ONE_TO_ALL)
    def sync_colocated(self, spec) -> SyncStats:
        params = self.engine_runner.params() if self.engine_runner is not None else None
        return self.sync_side.colocated(self.actor.model, self.rank, spec, params)

    @dispatch(Dispatch.ONE_TO_ALL)
    def start_send(self, spec) -> None:
        self.sync_side.start_send(self.actor.model, self.rank, spec)

    @dispatch(Dispatch.ONE_TO_ALL)
    def finish_send(self) -> SyncStats:
        return self.sync_side.finish_send()

    @dispatch(Dispatch.ONE_TO_ALL)
    def sync_checksums(self, spec) -> dict[int, float]:
        return TrainerSide.checksums(self.actor.model, self.rank, spec)

    @dispatch(Dispatch.DP_SPLIT)
    def compute_logprobs(self, batch: DataBatch) -> DataBatch:
        return DataBatch({"old_logp": self.actor.compute_logprobs(to_train(batch))})

    @dispatch(Dispatch.DP_SPLIT)
    def update(self, batch: DataBatch) -> dict:
        return self.actor.update(to_train(batch))  # stats already reduced over data-parallel ranks

    @dispatch(Dispatch.RANK_ZERO)
    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter as one full tensor: for exporting the final model and for the vLLM
        backend, whose loader takes full tensors. The rollout engine is synced by the plan."""
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
        self.engine_runner = None


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
        self.sync_side = TrainerSide()
        self.address = "127.0.0.1"

    def weights(self):
        return self.actor.model.state_dict().items()

    # ---- weight sync: this process is trainer rank 0 ----
    def sync_connect(self, host: str, port: int, members, timeout_s: float) -> None:
        self.sync_side.connect(host, port, 0, members, timeout_s)

    def sync_close(self) -> None:
        self.sync_side.close()

    def sync_colocated(self, spec, engine) -> SyncStats:
        """The engine's one rank is in this process too: every piece is an in-place copy."""
        run = lambda runner: self.sync_side.colocated(self.actor.model, 0, spec, runner.params())  # noqa: E731
        (stats,) = engine.run_on_ranks(run)
        return stats

    def start_send(self, spec) -> None:
        self.sync_side.start_send(self.actor.model, 0, spec)

    def finish_send(self) -> SyncStats:
        return self.sync_side.finish_send()

    def sync_checksums(self, spec) -> dict[int, float]:
        return TrainerSide.checksums(self.actor.model, 0, spec)

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
        self.address = self.actor.master_addr  # where the workers reach the driver (the sync's rendezvous)

    def weights(self):
        return self.actor.full_weights().items()

    # ---- weight sync ----
    def host_engine(self, model_config, dtype: torch.dtype, tp: int) -> "ActorHostedRanks":
        """Colocated: the engine's ranks in the actor processes (LLMEngine(runner_group=...))."""
        free = self.actor.init_engine(model_config, dtype, tp)
        return ActorHostedRanks(self.actor, tp, min(f for f in free if f is not None))

    def sync_connect(self, host: str, port: int, members, timeout_s: float) -> None:
        self.actor.sync_connect(host, port, members, timeout_s)

    def sync_close(self) -> None:
        self.actor.sync_close()

    def sync_colocated(self, spec, engine) -> SyncStats:
        return _total(self.actor.sync_colocated(spec))

    def start_send(self, spec) -> None:
        self.actor.start_send(spec)

    def finish_send(self) -> SyncStats:
        return _total(self.actor.finish_send())

    def sync_checksums(self, spec) -> dict[int, float]:
        return merge(self.actor.sync_checksums(spec))

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


def _total(parts: list[SyncStats]) -> SyncStats:
    out = SyncStats()
    for p in parts:
        out = out.add(p)
    return out


class ActorHostedRanks:
    """The engine's tensor-parallel ranks as hosted by actor ranks 0..tp-1 (the protocol LLMEngine
    expects of its runner group: call, call_all, run_fn, close)."""

    def __init__(self, actor_group, tp: int, free_bytes: int):
        self.group, self.tp, self.free_bytes = actor_group, tp, free_bytes

    def free_memory(self) -> int:
        return self.free_bytes

    def call(self, method: str, *args):
        return self.group.engine_call(method, args)[0]

    def call_all(self, method: str, *args) -> list:
        return self.group.engine_call(method, args)[: self.tp]

    def run_fn(self, fn, *args) -> list:
        return self.group.engine_run(fn, args)[: self.tp]

    def close(self) -> None:
        pass  # the actor group owns the processes
