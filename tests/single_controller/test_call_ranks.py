"""GroupHandle.call_ranks: a part of a worker group called on its own (a colocated fleet's replica on its share of the
trainer's ranks, relayrl.roles.fleet_colocated), and two parts called at once from two driver threads."""

from __future__ import annotations

import os
import threading
import time

import pytest

from relayrl.single_controller.dispatch import Dispatch, dispatch
from relayrl.single_controller.liveness import GroupOptions
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import Worker
from relayrl.single_controller.worker_group import WorkerGroup

pytestmark = pytest.mark.equivalence  # real worker processes


class NapWorker(Worker):
    def __init__(self):
        self.calls = 0

    @dispatch(Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> tuple[int, int, int]:
        """(rank, pid, calls so far) after sleeping `seconds`."""
        time.sleep(seconds)
        self.calls += 1
        return self.rank, os.getpid(), self.calls

    @dispatch(Dispatch.RANK_ZERO)
    def first(self) -> int:
        return self.rank


def test_some_ranks_alone_and_two_parts_at_once():
    group = WorkerGroup(ResourcePool([2], name="nap"), NapWorker, options=GroupOptions(backend="local"))
    try:
        assert [r for r, _, _ in group.call_ranks([1], NapWorker.nap, 0.0)] == [1]
        # rank 0 was not called: its count starts now; rank 1's is at 2
        assert [(r, n) for r, _, n in group.call_ranks([0, 1], NapWorker.nap, 0.0)] == [(0, 1), (1, 2)]
        got: dict[int, list] = {}

        def part(rank: int) -> None:
            got[rank] = group.call_ranks([rank], NapWorker.nap, 1.5)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=part, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert time.perf_counter() - t0 < 2.9  # at once: 1.5 s, not 3 s or more one after the other
        assert [got[r][0][0] for r in (0, 1)] == [0, 1] and got[0][0][1] != got[1][0][1]
        with pytest.raises(TypeError, match="ONE_TO_ALL"):
            group.call_ranks([0], NapWorker.first)
    finally:
        group.shutdown()
