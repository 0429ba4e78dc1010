"""ParallelConfig is the `parallel:` section of a run: how many processes the trainer uses, in what
layout, where the other roles run, and how long their calls may take.

This module is configuration only: it imports relayrl.config and pydantic, nothing that starts
processes or touches torch.distributed, so loading a run's config stays cheap. It must never import
another relayrl layer (models, single_controller, the trainer, the engine, ...): they import it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from relayrl.config import Config

# relayrl.parallel.pipeline's schedules (torch.distributed.pipelining), named as the planner names 1f1b / gpipe
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")


class CallTimeouts(Config):
    """Seconds a worker-group call of each kind may take (`parallel.call_timeout_s.<kind>`)."""

    build: float | None = Field(1800.0, gt=0)  # start the workers and build their models
    compute: float | None = Field(3600.0, gt=0)  # one step's model work (generate, update, logprobs, save)
    control: float | None = Field(300.0, gt=0)  # bookkeeping calls
    close: float | None = Field(120.0, gt=0)  # teardown at the end of the run


class ParallelConfig(Config):
    """How the trainer runs: in the driver's process, or as a worker group of dp x tp ranks."""

    backend: Literal["none", "local", "ray"] = "none"  # none: one process, the driver's own
    # where the trainer's models (actor, reference, critic) and relayrl's engine compute: auto is cuda when torch
    # sees a GPU, else cpu (relayrl.parallel.device.resolve_device; cuda without one is refused in one line).
    # Worker process r takes cuda:r of its pool; the driver's own process (backend none) cuda:0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dp_replicate: int = Field(1, ge=1)
    dp_shard: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    # context parallelism (relayrl.parallel.context_parallel, the planner's cp / cp_mode): each sequence split
    # over cp ranks, attending by ring (zigzag ring attention) or ulysses (all-to-all over heads). The cp ranks of
    # a data-parallel rank take the same rows; FSDP shards over dp_shard x cp. Runs need dp_mode fsdp and padded
    # rows (trainer.padding_free: false), and have no critic, LoRA, routing replay, pp or ep beside it
    cp: int = Field(1, ge=1)
    cp_mode: Literal["ring", "ulysses"] = "ring"
    # pipeline parallelism (relayrl.parallel.pipeline, the planner's pp / pp_schedule): the decoder layers split
    # into pp stages (outermost in the mesh), micro-batches of trainer.micro_batch_size rows run by the schedule,
    # for the actor and the reference. Runs need padded rows (trainer.padding_free: false), dp_mode fsdp when
    # dp > 1, a dense model, and have no critic, LoRA, cp or ep beside it
    pp: int = Field(1, ge=1)
    pp_schedule: str = "1f1b"
    # expert parallelism (relayrl.parallel.expert_parallel, the planner's ep): an MoE model's experts split over ep
    # ranks borrowed from dp_shard (ParallelDims: ep innermost, each ep rank holds num_experts / ep whole experts,
    # FSDP-sharded over the dp_shard / ep ranks holding the same ones); tp 1 and dp_mode fsdp
    ep: int = Field(1, ge=1)
    dp_mode: Literal["fsdp", "ddp"] = "fsdp"
    activation_checkpointing: bool = False
    # colocated: the rollout engine's ranks and the reference model run in the actor's processes
    # (engine rank r in actor rank r); disaggregated: each in processes of their own
    placement: Literal["colocated", "disaggregated"] = "colocated"
    rollout_worker: bool = False  # the engine in a worker group of its own instead of the driver
    reward_workers: int = Field(0, ge=0)  # score in N reward workers (0: in the driver's reward pool)
    # liveness: every worker-group call has a deadline by its kind; a worker that sends no heartbeat
    # for heartbeat_timeout_s is reported stopped or hung, and the run stops naming it
    call_timeout_s: CallTimeouts = Field(default_factory=CallTimeouts)
    heartbeat_timeout_s: float | None = Field(30.0, ge=2)

    @field_validator("pp_schedule")
    @classmethod
    def _known_schedule(cls, name: str) -> str:
        if name not in PP_SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(PP_SCHEDULES)}")
        return name

    @model_validator(mode="after")
    def _ep_fits(self) -> ParallelConfig:
        if self.ep == 1:
            return self
        if self.dp_shard % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide parallel.dp_shard={self.dp_shard} (expert parallelism "
                             "borrows its ranks from dp_shard)")
        if self.tp > 1:
            raise ValueError(f"parallel.ep={self.ep} with parallel.tp={self.tp}: experts are not tensor-parallel under "
                             "ep; set parallel.tp=1 or parallel.ep=1")
        if self.dp_mode != "fsdp":
            raise ValueError(f"parallel.ep={self.ep} shards the experts with FSDP; set parallel.dp_mode=fsdp")
        return self

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
