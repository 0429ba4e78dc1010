"""GroupHandle.call_ranks: a part of a worker group called on its own (a colocated fleet's replica on its share of the
trainer's ranks, relayrl.roles.fleet_colocated), and two parts called at once from two driver threads."""

from __future__ import annotations

import os
import threading
import time

import pytest

from relayrl.single_controller.dispatch import Dispatch, dispatch
from relayrl.single_controller.liveness import CHECK_S, GroupOptions, Liveness
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import Worker
from relayrl.single_controller.worker_group import WorkerGroup


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


@pytest.mark.equivalence  # real worker processes
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


class CountingStore:
    """A heartbeat store: each rank's beat count, and which ranks were read."""

    def __init__(self, beats: dict[str, int]):
        self.beats, self.read = beats, []

    def add(self, key: str, n: int) -> int:
        self.read.append(key)
        return self.beats.get(key, 0)


@pytest.mark.unit
def test_heartbeats_of_two_parts_are_each_read():
    """Two threads waiting on disjoint ranks each get their ranks' heartbeats read (one rank's read time does not
    hold back another's), and a rank is read at most once per CHECK_S."""
    store = CountingStore({})
    live = Liveness(store, 2, timeout_s=30.0)
    assert live.stale([0]) == [] and live.stale([1]) == []
    assert len(store.read) == 2 and store.read[0] != store.read[1]  # both ranks read, one call after the other
    assert live.stale([0, 1]) == [] and len(store.read) == 2  # within CHECK_S of their last read: not again
    live._last_check = [t - CHECK_S for t in live._last_check]
    live._changed[1] -= 31.0
    live._started[1] = True
    assert [r for r, _ in live.stale([0, 1])] == [1]  # rank 1 quiet for over 30 s: stopped or hung
