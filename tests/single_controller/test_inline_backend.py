"""The inline worker-group backend: a role written once as a Worker runs in the driver's process behind the same
WorkerGroup calls as in worker processes. Checked against the local backend on the same worker class (the same
results for every dispatch mode), and for what inline promises beyond that: no copies (the worker gets and
returns the caller's objects), no process and no change to the driver's threads, errors as the group reports
them, teardown at shutdown, and a clear refusal for a worker that needs a process group."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from relayrl.errors import ConfigError
from relayrl.parallel.launch import WorkerError
from relayrl.single_controller.batch import DataBatch
from relayrl.single_controller.dispatch import Dispatch, dispatch
from relayrl.single_controller.liveness import Deadlines, GroupOptions
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import Worker
from relayrl.single_controller.worker_group import WorkerGroup

pytestmark = pytest.mark.equivalence

TEARDOWNS: list[int] = []


def opts(backend: str) -> GroupOptions:
    return GroupOptions(backend=backend, deadlines=Deadlines(build=60, compute=60, control=60), threads=1)


class Scaler(Worker):
    """No process group: what a reward scorer or a rollout worker looks like to its group."""

    def __init__(self, scale: float):
        self.scale = scale

    @dispatch(Dispatch.DP_SPLIT)
    def scaled(self, batch: DataBatch) -> DataBatch:
        return DataBatch({"y": batch.tensors["x"] * self.scale + self.rank})

    @dispatch(Dispatch.DP_SPLIT)
    def same(self, batch: DataBatch) -> DataBatch:
        return batch

    @dispatch(Dispatch.ONE_TO_ALL)
    def where(self) -> tuple[int, int, int]:
        return self.rank, self.world_size, os.getpid()

    @dispatch(Dispatch.RANK_ZERO)
    def echo(self, obj):
        return obj

    @dispatch(Dispatch.RANK_ZERO)
    def fail(self, user: bool):
        raise ConfigError("a user's mistake, in one line") if user else KeyError("a bug")

    @dispatch(Dispatch.RANK_ZERO)
    def interrupted(self):
        raise KeyboardInterrupt

    @dispatch(Dispatch.RANK_ZERO)
    def held(self, log: list, name: str, seconds: float):
        log.append(("in", name))
        time.sleep(seconds)
        log.append(("out", name))

    def teardown(self) -> None:
        TEARDOWNS.append(self.rank)


class NeedsGroup(Worker):
    def __init__(self):
        self.init_distributed()


@pytest.mark.parametrize("world", [1, 2])
def test_inline_results_equal_the_local_backend_for_every_dispatch_mode(world):
    x = torch.arange(12.0).reshape(6, 2)
    out = {}
    for backend in ("local", "inline"):
        with WorkerGroup(ResourcePool([world], name="scaler"), Scaler, 2.5, options=opts(backend)) as g:
            out[backend] = (g.call(Scaler.scaled, DataBatch({"x": x})).tensors["y"],
                            [w[:2] for w in g.call(Scaler.where)], g.call(Scaler.echo, {"a": [1, 2]}))
    assert torch.equal(out["local"][0], out["inline"][0])
    assert out["local"][1:] == out["inline"][1:] == ([(r, world) for r in range(world)], {"a": [1, 2]})


def test_inline_runs_in_this_process_without_copies_or_thread_changes():
    threads = torch.get_num_threads()
    TEARDOWNS.clear()
    with WorkerGroup(ResourcePool([2], name="scaler"), Scaler, 1.0, options=opts("inline")) as g:
        assert {pid for *_, pid in g.call(Scaler.where)} == {os.getpid()}
        obj = {"big": torch.zeros(4)}
        assert g.call(Scaler.echo, obj) is obj  # the same object: nothing pickled
        assert torch.get_num_threads() == threads  # GroupOptions.threads is the worker processes', not ours
    assert TEARDOWNS == [0, 1]
    with WorkerGroup(ResourcePool([1], name="scaler"), Scaler, 1.0, options=opts("inline")) as g:
        x = torch.arange(6.0).reshape(3, 2)  # a world of 1: DP_SPLIT's one chunk and its "concat" copy nothing
        assert g.call(Scaler.same, DataBatch({"x": x})).tensors["x"].data_ptr() == x.data_ptr()


def test_inline_errors_come_back_as_the_groups_do():
    with WorkerGroup(ResourcePool([1], name="scaler"), Scaler, 1.0, options=opts("inline")) as g:
        with pytest.raises(ConfigError, match="^a user's mistake, in one line$"):
            g.call(Scaler.fail, True)
        with pytest.raises(WorkerError, match="KeyError: 'a bug'"):
            g.call(Scaler.fail, False)
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C in the driver's process stays a Ctrl-C
            g.call(Scaler.interrupted)
        assert g.call(Scaler.echo, 7) == 7  # and the group goes on


def test_an_inline_worker_that_needs_a_process_group_is_refused_in_words():
    with pytest.raises(WorkerError, match="inline worker group .* run it on the local or ray backend"):
        WorkerGroup(ResourcePool([1], name="needs"), NeedsGroup, options=opts("inline"))


def test_inline_calls_from_two_threads_run_one_at_a_time():
    """A stream's thread and the driver's calling one inline group: the second call waits for the first (as a worker
    process serves its calls one by one) instead of interleaving with it."""
    group = WorkerGroup(ResourcePool([1]), Scaler, 1.0, options=opts("inline"))
    try:
        log: list = []
        other = threading.Thread(target=group.call, args=(Scaler.held, log, "thread", 0.2))
        other.start()
        time.sleep(0.05)  # the thread's call is under way
        group.call(Scaler.held, log, "driver", 0.0)
        other.join()
        assert log == [("in", "thread"), ("out", "thread"), ("in", "driver"), ("out", "driver")]
    finally:
        group.shutdown()
