"""This module runs the engine's tensor-parallel ranks in processes of their own, as a worker group of
ModelRunners.

    driver process (scheduler, sampler) ── WorkerGroup ──> rank 0: RunnerWorker ┐ gloo / nccl
                                                       ──> rank 1: RunnerWorker ├ all-reduce inside
                                                       ──> ...                  ┘ the forward
    call(fn, ...)      fn(runner, *args) on every rank (fn: a ModelRunner method, e.g. ModelRunner.run, or a
                       module-level function; pickled by its qualified name); rank 0's result comes back
                       (all ranks compute the same logits, so the others answer None instead of sending theirs)
    call_all(fn, ...)  every rank's result — how the layers above the engine (the weight sync) act on a
                       rank's parameters without the engine importing them

The ranks are an ordinary relayrl.single_controller worker group, so they start, rendezvous (the
group's own store: no free-port race), are watched (deadlines, heartbeats) and stop like every other
role's processes, and die with the process that started them. The starting process joins no process
group, so a trainer in the same process keeps its own.

This module imports the engine's own modules, relayrl.models and relayrl.single_controller only; it must
never import the trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from relayrl.engine.model_runner import ModelRunner, available_memory
from relayrl.engine.parallel_state import TPInfo
from relayrl.models.config import ModelConfig
from relayrl.single_controller.dispatch import Dispatch, dispatch
from relayrl.single_controller.liveness import GroupOptions
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import Worker
from relayrl.single_controller.worker_group import WorkerGroup


class RunnerWorker(Worker):
    """One tensor-parallel rank: its ModelRunner shard, in the group's default process group."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, expert_placement: str = "tp"):
        self.init_distributed()
        group = dist.group.WORLD if self.world_size > 1 else None
        self.runner = ModelRunner(cfg, dtype, TPInfo(self.rank, self.world_size, group), self.device,
                                  expert_placement)

    @dispatch(Dispatch.ONE_TO_ALL)
    def run_on_rank(self, fn: Callable[..., Any], args: tuple, every_rank: bool) -> Any:
        """fn(this rank's runner, *args); None from ranks other than 0 unless every_rank."""
        result = fn(self.runner, *args)
        return result if every_rank or self.rank == 0 else None

    @dispatch(Dispatch.ONE_TO_ALL, deadline="control")
    def free_memory(self) -> int:
        return available_memory(str(self.runner.device))

    def teardown(self) -> None:
        del self.runner


class WorkerRanks:
    """The RunnerGroup of an engine whose ranks run in a worker group of their own."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp_size: int, *, device: str = "cpu",
                 options: GroupOptions | None = None, expert_placement: str = "tp"):
        pool = ResourcePool([tp_size], device=device, name="rollout-tp")
        self.group = WorkerGroup(pool, RunnerWorker, cfg, dtype, expert_placement, options=options)

    def call(self, fn: Callable[..., Any], *args) -> Any:
        return self.group.call(RunnerWorker.run_on_rank, fn, args, False)[0]

    def call_all(self, fn: Callable[..., Any], *args) -> list:
        return self.group.call(RunnerWorker.run_on_rank, fn, args, True)

    def free_memory(self) -> int:
        return min(self.group.call(RunnerWorker.free_memory))

    def close(self) -> None:
        self.group.shutdown(raise_errors=False)
