"""The engine's rank worker, RunnerWorker, wherever its group is: ranks >= tp of a group placed beside another
role host nothing (and are left out of call_all and the KV budget); a WorkerRanks over a handle it does not own
stops nothing; inline, the engine calls the worker's runner object itself."""

from __future__ import annotations

import pytest
import torch

from relayrl.engine.runner_groups import InProcessRunner
from relayrl.engine.tp_workers import RunnerWorker, WorkerRanks, colocated_ranks
from relayrl.models import ModelConfig
from relayrl.single_controller.liveness import GroupOptions
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker_group import WorkerGroup

from helpers import SYNC_CONFIGS


def _tp(runner) -> tuple[int, int]:
    return runner.tp.rank, runner.tp.size


@pytest.mark.equivalence
def test_ranks_beyond_tp_host_nothing_and_a_borrowed_group_outlives_its_ranks():
    cfg = ModelConfig(**SYNC_CONFIGS["gqa8x2"])
    with WorkerGroup(ResourcePool([2], name="shared"), RunnerWorker, cfg, torch.float32, "tp", 1,
                     options=GroupOptions(backend="local")) as group:
        assert group.call(RunnerWorker.free_memory)[1] is None  # rank 1 hosts no runner
        ranks = WorkerRanks.of(group, 1)
        assert ranks.call_all(_tp) == [(0, 1)]
        # rank 0's free device memory (rank 1 hosts none): the machine's free memory, read twice, moves by a few
        # pages between the two reads (a run of the suite saw 32 KB of 18.6 GB)
        got, rank0 = ranks.free_memory(), group.call(RunnerWorker.free_memory)[0]
        assert rank0 > 0 and abs(got - rank0) <= 2**20 + rank0 // 1000
        ranks.close()  # the group's owner stops it, not the engine
        assert ranks.call(_tp) == (0, 1)


@pytest.mark.unit
def test_inline_ranks_are_the_runner_object_itself():
    cfg = ModelConfig(**SYNC_CONFIGS["gqa8x2"])
    with WorkerGroup(ResourcePool([1]), RunnerWorker, cfg, torch.float32,
                     options=GroupOptions(backend="inline")) as group:
        ranks = colocated_ranks(group, 1)
        assert isinstance(ranks, InProcessRunner) and ranks.runner is group.call(RunnerWorker.local_runner)
        assert ranks.call(_tp) == (0, 1)
