"""Worker groups on real processes, the same tests on the local backend and on Ray.

The toy workers form real gloo process groups (an all_reduce inside SPMD methods), so these check
the rendezvous, the dispatch modes across processes, error propagation and the teardown order.
At most 4 worker processes are alive at a time: the 4-rank group lives for TestSPMD (class scope)
and is shut down before the other tests start theirs. Starting a process (importing torch) is most
of the cost, so the tests share groups where they can.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from relayrl.parallel import host_memory
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.launch import WorkerError
from relayrl.single_controller.batch import DataBatch
from relayrl.single_controller.dispatch import Dispatch, DPInfo, dispatch
from relayrl.single_controller.liveness import Deadlines, GroupOptions
from relayrl.single_controller.placement import spawn_roles
from relayrl.single_controller.resource_pool import ResourcePool, colocated, split_pool
from relayrl.single_controller.worker import ColocatedWorker, Worker, dp_info_from_dims
from relayrl.single_controller.worker_group import WorkerGroup

TIMEOUT = 60


def opts(backend: str, **kw) -> GroupOptions:
    return GroupOptions(backend=backend, deadlines=Deadlines(build=TIMEOUT, compute=TIMEOUT, control=TIMEOUT), **kw)


class ToyWorker(Worker):
    """world = dp x tp (tp fastest); `scale` stands for a model."""

    def __init__(self, tp: int = 1, scale: float = 1.0):
        self.init_distributed()
        self.dims = ParallelDims(dp_shard=-1, tp=tp, world_size=self.world_size)
        self.scale = scale
        self.seen: list[list[int]] = []  # row ids of each DP_SPLIT chunk received

    def dp_info(self) -> DPInfo:
        return dp_info_from_dims(self.rank, self.dims)

    @dispatch(Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return dict(rank=self.rank, world_size=self.world_size, pid=os.getpid(), dist_rank=dist.get_rank(),
                    host_memory=host_memory.basis())

    @dispatch(Dispatch.RANK_ZERO)
    def all_reduce_sum(self, x: float) -> float:
        t = torch.tensor([x * (self.rank + 1)])
        dist.all_reduce(t)
        return float(t)

    @dispatch(Dispatch.DP_SPLIT)
    def transform(self, batch: DataBatch, offset: float = 0.0) -> DataBatch:
        self.seen.append(batch["row_id"].tolist())
        rows = torch.tensor([len(batch)])
        dist.all_reduce(rows)  # a collective inside the split method: every rank must take part
        out = DataBatch({"y": batch["x"] * self.scale + offset, "row_id": batch["row_id"],
                         "tp_rank": torch.full((len(batch),), self.rank % self.dims.tp)},
                        meta={"world_rows": int(rows)},
                        non_tensors={"text": [t.upper() for t in batch["text"]]})
        return out

    @dispatch(Dispatch.ONE_TO_ALL)
    def seen_rows(self) -> list[list[int]]:
        return self.seen

    @dispatch(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"boom on rank {rank}")
        return self.rank

    @dispatch(Dispatch.RANK_ZERO)
    def fail_before_collective(self, rank: int) -> float:
        if self.rank == rank:
            raise ValueError("failed before the all_reduce")
        t = torch.ones(1)
        dist.all_reduce(t)  # the peers wait here for the rank that failed
        return float(t)

    def plain(self, x: int) -> int:
        return self.rank * x


class SpinWorker(Worker):
    """Alive and beating, but one of its calls never returns (an endless loop holding its main thread)."""

    @dispatch(Dispatch.ONE_TO_ALL)
    def spin(self) -> None:
        while True:
            pass

    @dispatch(Dispatch.ONE_TO_ALL, deadline="control")
    def pid(self) -> int:
        return os.getpid()


class BrokenWorker(Worker):
    def __init__(self):
        raise RuntimeError("cannot build this worker")


class ScoreWorker(Worker):
    """A seeded linear "model" that scores rows: stands for actor / reference logprobs."""

    def __init__(self, seed: int):
        self.init_distributed()
        self.model = reference_model(seed)

    @dispatch(Dispatch.DP_SPLIT)
    def score(self, batch: DataBatch) -> DataBatch:
        with torch.no_grad():
            y = self.model(batch["x"])
        return DataBatch({"score": y, "pid": torch.full((len(batch),), os.getpid())})

    @dispatch(Dispatch.RANK_ZERO)
    def weight_sum(self) -> float:
        t = self.model.weight.detach().sum().reshape(1)
        dist.all_reduce(t)
        return float(t) / self.world_size  # same seed everywhere: the mean is any rank's value

    def teardown(self) -> None:
        del self.model


class SharedProcess(ColocatedWorker):
    """Hosts colocated roles; a method of its own uses two of them in-process (like a weight sync)."""

    @dispatch(Dispatch.ONE_TO_ALL)
    def copy_actor_to_reference(self) -> int:
        self.reference.model.load_state_dict(self.actor.model.state_dict())
        return os.getpid()


def reference_model(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


# ---------------------------------------------------------------- backends


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    here = Path(__file__).resolve().parent
    # Ray workers must import this module (the toy workers) and relayrl (from the repository, two levels up)
    path = os.pathsep.join([str(here.parents[1]), str(here)])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module", params=["local", "ray"])
def backend(request) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


# ---------------------------------------------------------------- one SPMD group: dp 2 x tp 2


@pytest.fixture(scope="class")
def toy(backend):
    with WorkerGroup(ResourcePool([4]), ToyWorker, tp=2, scale=3.0, options=opts(backend, error_grace_s=10)) as group:
        yield group


class TestSPMD:
    @pytest.mark.equivalence
    def test_one_to_all_and_layout(self, toy):
        out = toy.call(ToyWorker.whoami)
        assert [o["rank"] for o in out] == [0, 1, 2, 3]
        assert [o["dist_rank"] for o in out] == [0, 1, 2, 3]
        assert {o["world_size"] for o in out} == {4}
        assert len({o["pid"] for o in out}) == 4
        # every worker applied the allocator policy before it was built (the default, unless the run's
        # environment names a glibc malloc setting)
        assert [o["host_memory"] for o in out] == [host_memory.plan()] * 4
        assert toy.layout == [DPInfo(0, 2, True), DPInfo(0, 2, False), DPInfo(1, 2, True), DPInfo(1, 2, False)]
        assert toy.dp_size == 2

    @pytest.mark.equivalence
    def test_rank_zero_all_reduce(self, toy):
        assert toy.call(ToyWorker.all_reduce_sum, 1.0) == 1 + 2 + 3 + 4

    @pytest.mark.equivalence
    def test_dp_split_order_and_tp_peers(self, toy):
        n = 5  # uneven: dp rank 0 gets rows 0-2, dp rank 1 rows 3-4
        x = torch.randn(n, 2)
        batch = DataBatch({"x": x, "row_id": torch.arange(n)}, meta={"step": 7},
                          non_tensors={"text": [f"row {i}" for i in range(n)]})
        before = [len(s) for s in toy.call(ToyWorker.seen_rows)]
        out = toy.call(ToyWorker.transform, batch, offset=0.5)
        assert isinstance(out, DataBatch) and len(out) == n
        torch.testing.assert_close(out["y"], x * 3.0 + 0.5)
        assert out["row_id"].tolist() == list(range(n))
        assert out["text"] == [f"ROW {i}" for i in range(n)]
        assert out["tp_rank"].tolist() == [0] * n  # only the representatives' results come back
        assert out.meta["world_rows"] == 2 * n  # each row went to both TP peers of its dp rank
        seen = [s[b] for s, b in zip(toy.call(ToyWorker.seen_rows), before, strict=True)]
        assert seen == [[0, 1, 2], [0, 1, 2], [3, 4], [3, 4]]

    @pytest.mark.equivalence
    def test_plain_methods(self, toy):
        assert toy.execute_all("plain", 2) == [0, 2, 4, 6]
        assert toy.execute_rank0("plain", 5) == 0
        with pytest.raises(TypeError, match="not declared with @dispatch"):
            toy.call("plain", 1)
        assert toy.call("all_reduce_sum", 2.0) == 20.0

    @pytest.mark.faults
    def test_error_carries_worker_traceback(self, toy):
        with pytest.raises(WorkerError) as info:
            toy.call(ToyWorker.fail_on, 2)
        err = info.value
        assert err.rank == 2
        assert "boom on rank 2" in str(err) and "in fail_on" in err.traceback_text
        assert isinstance(err.__cause__, ValueError)
        assert [o["rank"] for o in toy.call(ToyWorker.whoami)] == [0, 1, 2, 3]  # the group is still usable

    @pytest.mark.faults
    def test_failure_inside_collective_breaks_group(self, toy):
        """Runs last in this class: it leaves the group broken (the fixture's shutdown kills it)."""
        toy.options = dataclasses.replace(toy.options, error_grace_s=1)
        with pytest.raises(WorkerError, match="failed before the all_reduce") as info:
            toy.call(ToyWorker.fail_before_collective, 3)
        assert info.value.rank == 3 and "did not answer" in str(info.value)
        with pytest.raises(RuntimeError, match="broken"):
            toy.call(ToyWorker.whoami)


# ---------------------------------------------------------------- failures


@pytest.mark.faults
def test_construction_error(backend):
    with pytest.raises(WorkerError, match="cannot build this worker"):
        WorkerGroup(ResourcePool([1]), BrokenWorker, options=opts(backend))


@pytest.mark.faults
def test_a_call_past_its_deadline_stops_the_group_in_one_line():
    """The heartbeat cannot see an endless loop (the beating thread still runs): the call's deadline does."""
    from relayrl.single_controller.liveness import CallDeadlineError

    options = GroupOptions(deadlines=Deadlines(compute=2.0), heartbeat_timeout_s=2.0)
    group = WorkerGroup(ResourcePool([1], name="spinner"), SpinWorker, options=options)
    (pid,) = group.call(SpinWorker.pid)
    t0 = time.monotonic()
    with pytest.raises(CallDeadlineError) as info:
        group.call(SpinWorker.spin)
    assert 2.0 <= time.monotonic() - t0 < 10
    assert str(info.value) == (
        "'spin' on spinner ran past its compute deadline of 2s (parallel.call_timeout_s.compute): "
        f"spinner worker rank 0 (pid {pid}) did not answer; the group is stopped")
    with pytest.raises(RuntimeError, match="broken"):
        group.call(SpinWorker.pid)
    group.shutdown()  # a broken group's shutdown kills without raising
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"


# ---------------------------------------------------------------- placement


ROLE_SPECS = {"actor": (ScoreWorker, (0,)), "reference": (ScoreWorker, (1,))}


def driver_step(roles, batch: DataBatch) -> tuple[DataBatch, DataBatch, float]:
    """The same driver code for every placement."""
    return roles["actor"].call(ScoreWorker.score, batch), roles["reference"].call(ScoreWorker.score, batch), \
        roles["actor"].call(ScoreWorker.weight_sum)


@pytest.mark.equivalence
def test_colocated_and_disaggregated_agree(backend):
    x = torch.randn(6, 3)
    batch = DataBatch({"x": x})
    placements = {
        "colocated": colocated(ResourcePool([2], name="shared"), ["actor", "reference"]),
        "disaggregated": split_pool(ResourcePool([2]), {"actor": 1, "reference": 1}),
    }
    results = {}
    for name, placement in placements.items():
        with spawn_roles(placement, ROLE_SPECS, options=opts(backend), colocated_cls=SharedProcess) as roles:
            assert roles["actor"].dp_size == (2 if name == "colocated" else 1)
            results[name] = driver_step(roles, batch)
            if name == "colocated":
                assert roles["actor"].group is roles["reference"].group
                pids = roles["actor"].group.call(SharedProcess.copy_actor_to_reference)
                assert sorted(pids) == sorted(set(results[name][0]["pid"].tolist()))
                torch.testing.assert_close(roles["reference"].call(ScoreWorker.score, batch)["score"],
                                           results[name][0]["score"])
    with torch.no_grad():
        expect_actor, expect_ref = reference_model(0)(x), reference_model(1)(x)
    for name, (actor, ref, wsum) in results.items():
        torch.testing.assert_close(actor["score"], expect_actor, msg=name)
        torch.testing.assert_close(ref["score"], expect_ref, msg=name)
        assert wsum == pytest.approx(float(reference_model(0).weight.detach().sum()), rel=1e-6)
    co_actor, co_ref, _ = results["colocated"]
    assert torch.equal(co_actor["pid"], co_ref["pid"])  # same processes host both roles
    assert len(set(co_actor["pid"].tolist())) == 2  # ... split over its 2 dp ranks
    dis_actor, dis_ref, _ = results["disaggregated"]
    assert not set(dis_actor["pid"].tolist()) & set(dis_ref["pid"].tolist())  # separate processes
