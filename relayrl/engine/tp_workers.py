"""This module is the engine's rank worker, RunnerWorker, and the RunnerGroup over a worker group of them,
WorkerRanks: one class wherever the group's processes are.

    disaggregated   WorkerRanks(cfg, dtype, tp): a worker group of tp RunnerWorkers in processes of their own
                    (closing the engine stops them)
    colocated       WorkerRanks.of(handle, tp): RunnerWorkers placed in the actor's processes, one beside each
                    actor rank (relayrl.single_controller.placement.spawn_roles on the actor's pool); ranks
                    >= tp host nothing, and the group's owner (the trainer's) stops the processes. With
                    `replicas` engines (a colocated fleet), process p holds replica p // tp's rank p % tp
                    (ranks >= replicas * tp none), and WorkerRanks.of(handle, tp, first=k * tp) is replica k's

    driver process (scheduler, sampler) ── WorkerGroup ──> rank 0: RunnerWorker ┐ gloo / nccl
                                                       ──> rank 1: RunnerWorker ├ all-reduce inside
                                                       ──> ...                  ┘ the forward
    call(fn, ...)      fn(runner, *args) on every rank (fn: a ModelRunner method, e.g. ModelRunner.run, or a
                       module-level function; pickled by its qualified name); rank 0's result comes back
                       (all ranks compute the same logits, so the others answer None instead of sending theirs)
    call_all(fn, ...)  every engine rank's result — how the layers above the engine (the weight sync) act on a
                       rank's parameters without the engine importing them

The ranks are an ordinary relayrl.single_controller worker group, so they start, rendezvous (the
group's own store: no free-port race), are watched (deadlines, heartbeats) and stop like every other
role's processes, and die with the process that started them. The starting process joins no process
group, so a trainer in the same process keeps its own. An inline group (the driver's own process, a world
of 1) joins none either: its runner is an object of this process (RunnerWorker.local_runner), which the
engine calls directly (relayrl.engine.runner_groups.InProcessRunner).

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
from relayrl.engine.protocols import RunnerGroup
from relayrl.engine.runner_groups import InProcessRunner
from relayrl.models.config import ModelConfig
from relayrl.single_controller.dispatch import Dispatch, dispatch
from relayrl.single_controller.liveness import GroupOptions
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import Worker
from relayrl.single_controller.worker_group import GroupHandle, WorkerGroup


class RunnerWorker(Worker):
    """One tensor-parallel rank: its ModelRunner shard (`runner`; None on ranks >= tp, which host none)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, expert_placement: str = "tp", tp: int | None = None,
                 replicas: int = 1):
        """replicas: engines of tp ranks each in this group (a colocated fleet): this process holds replica
        rank // tp's engine rank rank % tp."""
        tp = self.world_size if tp is None else tp
        if self.in_group:  # a no-op where a colocated role already joined
            self.init_distributed()
        if replicas == 1:
            group = tp_group(tp, self.world_size) if self.in_group else None
        else:  # every process takes part in making every replica's group, in order, and keeps its own
            groups = [replica_group(k * tp, tp, self.world_size) for k in range(replicas)]
            group = groups[self.rank // tp] if self.rank < replicas * tp else None
        self.runner = (ModelRunner(cfg, dtype, TPInfo(self.rank % tp, tp, group), self.device, expert_placement)
                       if self.rank < replicas * tp else None)

    @dispatch(Dispatch.ONE_TO_ALL)
    def run_on_rank(self, fn: Callable[..., Any], args: tuple, every_rank: bool) -> Any:
        """fn(this rank's runner, *args); None from ranks hosting none, and from ranks other than its engine's rank 0
        unless every_rank (they all compute the same)."""
        if self.runner is None:
            return None
        result = fn(self.runner, *args)
        return result if every_rank or self.runner.tp.rank == 0 else None

    @dispatch(Dispatch.ONE_TO_ALL, deadline="control")
    def free_memory(self) -> int | None:
        """The free bytes of this rank's device (the KV cache's budget base); None where no runner is hosted."""
        return available_memory(str(self.runner.device)) if self.runner is not None else None

    @dispatch(Dispatch.RANK_ZERO, deadline="control")
    def local_runner(self) -> ModelRunner:
        """The runner object itself: inline groups only (the driver's process), whose engine calls it directly."""
        if self.in_group:
            raise RuntimeError("local_runner hands over the runner object itself: inline groups only")
        return self.runner

    def teardown(self) -> None:
        self.runner = None


def tp_group(tp: int, world_size: int):
    """The engine's tensor-parallel process group over ranks 0..tp-1 (None at tp 1); every rank of the world
    takes part in making it, member or not."""
    if tp == 1:
        return None
    return dist.group.WORLD if tp == world_size else dist.new_group(list(range(tp)))


def replica_group(first: int, tp: int, world_size: int):
    """The tensor-parallel process group over ranks first..first+tp-1 (None at tp 1); every rank of the world takes
    part in making it."""
    if tp == 1:
        return None
    return dist.group.WORLD if tp == world_size else dist.new_group(list(range(first, first + tp)))


class WorkerRanks:
    """The RunnerGroup of an engine whose ranks are RunnerWorkers: a worker group of their own, or placed
    beside another role's workers (`of`)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp_size: int, *, device: str = "cpu",
                 options: GroupOptions | None = None, expert_placement: str = "tp"):
        kind, _, index = str(device).partition(":")  # cuda:3: ranks on cuda:3..3+tp-1 (a fleet's replica's GPUs)
        pool = ResourcePool([tp_size], device=kind, name="rollout-tp", device_offset=[int(index or 0)])
        self.group: GroupHandle = WorkerGroup(pool, RunnerWorker, cfg, dtype, expert_placement, options=options)
        self.tp, self.owned = tp_size, True

    first: int | None = None  # a replica of a colocated fleet: its ranks first..first+tp-1 alone are called

    @classmethod
    def of(cls, handle: GroupHandle, tp: int, first: int | None = None) -> WorkerRanks:
        """The ranks of a RunnerWorker role already placed (ranks 0..tp-1 host the engine; with `first`, a colocated
        fleet's replica: ranks first..first+tp-1, called on their own); its owner stops it."""
        ranks = cls.__new__(cls)
        ranks.group, ranks.tp, ranks.owned, ranks.first = handle, tp, False, first
        return ranks

    def _on_ranks(self, method, *args) -> list:
        if self.first is None:
            return self.group.call(method, *args)
        return self.group.call_ranks(range(self.first, self.first + self.tp), method, *args)

    def call(self, fn: Callable[..., Any], *args) -> Any:
        return self._on_ranks(RunnerWorker.run_on_rank, fn, args, False)[0]

    def call_all(self, fn: Callable[..., Any], *args) -> list:
        return self._on_ranks(RunnerWorker.run_on_rank, fn, args, True)[: self.tp]

    def free_memory(self) -> int:
        return min(f for f in self._on_ranks(RunnerWorker.free_memory) if f is not None)

    def close(self) -> None:
        if self.owned:
            self.group.shutdown(raise_errors=False)


def colocated_ranks(handle: GroupHandle, tp: int, replica: int | None = None) -> RunnerGroup:
    """The RunnerGroup of a RunnerWorker role placed beside another's: inline (the driver's own process, a world
    of 1), its runner called directly, so a rollout thread steps it without a group call per step; else the
    group's ranks 0..tp-1 (replica k of a colocated fleet: ranks k*tp..k*tp+tp-1)."""
    if handle.group.backend_name == "inline":
        return InProcessRunner(handle.call(RunnerWorker.local_runner))
    return WorkerRanks.of(handle, tp) if replica is None else WorkerRanks.of(handle, tp, first=replica * tp)
