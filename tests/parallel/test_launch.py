"""The multi-process harness itself: results by rank, a rank's exception re-raised, a hang killed."""

import time

import pytest
import torch
import torch.distributed as dist

from dist_harness import WorkerError, run_distributed


def _sum_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t * scale}


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()  # rank 0 waits for a peer that never comes: the harness must kill it


def _hangs(rank, world_size):
    time.sleep(600)


@pytest.mark.equivalence
def test_results_come_back_by_rank_and_errors_carry_the_child_traceback():
    results = run_distributed(_sum_ranks, 2, 10.0)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(torch.equal(r["sum"], torch.tensor([10.0])) for r in results)

    with pytest.raises(WorkerError, match="rank one is unhappy") as info:
        run_distributed(_rank1_raises, 2)
    assert info.value.rank == 1
    assert "_rank1_raises" in info.value.traceback_text  # the child's own frames
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.faults
def test_a_hang_is_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="exceeded 3s"):
        run_distributed(_hangs, 2, timeout=3)
    assert time.monotonic() - start < 30
