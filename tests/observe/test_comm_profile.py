"""The trainer's collectives measured by torch.profiler (relayrl.observe.comm_profile): the interval union by
hand, FSDP2 and DDP on 2 gloo ranks against the collectives' own count and the block's wall time, and a 2-rank
FSDP run that logs time/update_comm (a part of time/update) on its profiled steps only."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from relayrl.jobs.train import train
from relayrl.observe import read_metrics
from relayrl.observe.comm_profile import CommProfile, is_collective, union_seconds

from dist_harness import run_distributed
from helpers import group_cfg


@pytest.mark.unit
def test_union_of_intervals_by_hand():
    # [0, 10] and [5, 20] overlap: 20 us; [30, 31] apart: 1 us; [2, 3] inside the first: nothing more
    assert union_seconds([(5.0, 20.0), (0.0, 10.0), (30.0, 31.0), (2.0, 3.0)]) == 21e-6
    assert union_seconds([]) == 0.0


@pytest.mark.unit
def test_what_counts_as_a_collective():
    assert is_collective("gloo:all_gather", False) and is_collective("gloo:all_reduce", False)
    # the dispatcher's enqueue, FSDP's spans (copies + wait) and NCCL's CPU-side launch are not the collective
    for name in ("c10d::allreduce_", "c10d::_allgather_base_", "FSDP::all_gather (0)", "nccl:all_reduce",
                 "aten::mm"):
        assert not is_collective(name, False), name
    assert is_collective("ncclDevKernel_AllReduce_Sum_f32_RING_LL", True) and not is_collective("gemm", True)


@pytest.mark.unit
def test_disabled_measures_nothing():
    with CommProfile(False) as comm:
        torch.ones(2).sum()
    assert comm.seconds is None and comm.metrics() == {}


def _profiled(rank, world, mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64)
    with CommProfile(True) as comm:
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return comm.seconds, comm.wall, comm.metrics()


def _both(rank, world):
    with CommProfile(True) as none:  # local work only
        torch.randn(64, 64).matmul(torch.randn(64, 64)).sum()
    out = {mode: _profiled(rank, world, mode) for mode in ("fsdp", "ddp")}
    dist.barrier()
    return out, none.seconds


@pytest.mark.equivalence
def test_fsdp2_and_ddp_collectives_are_measured_within_the_wall_time():
    for out, none in run_distributed(_both, 2):
        assert none == 0.0
        for mode, (seconds, wall, metrics) in out.items():
            assert 0 < seconds < wall, (mode, seconds, wall)
            assert metrics == {"time/update_comm": seconds, "comm/update_share": seconds / wall}


@pytest.mark.e2e
def test_a_two_rank_fsdp_run_logs_its_updates_collectives(tmp_path):
    cfg = group_cfg(tmp_path, "fsdp2", backend="local", dp_shard=2)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"steps": 3, "profile_every": 2})})
    res = train(cfg, show_progress=False)
    steps = [m for m in read_metrics(res["run_dir"]) if "reward/mean" in m]
    assert len(steps) == 3
    profiled = [m for m in steps if "time/update_comm" in m]
    assert [m["step"] for m in profiled] == [steps[1]["step"]]  # the 2nd step of every 2
    m = profiled[0]
    assert 0 < m["time/update_comm"] < m["time/update"]
    assert 0 < m["comm/update_share"] < 1
