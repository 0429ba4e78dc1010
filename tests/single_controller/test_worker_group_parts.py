"""The single controller's parts in one process: DataBatch, dispatch split/collect, resource pools,
worker construction. (tests/single_controller/test_worker_group.py runs them across real processes.)"""

from __future__ import annotations

import pickle

import pytest
import torch

from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.rendezvous import StoreAddress
from relayrl.single_controller.batch import DataBatch, chunk_sizes
from relayrl.single_controller.dispatch import (
    Dispatch,
    DPInfo,
    check_layout,
    collect_outputs,
    dispatch,
    dispatch_mode,
    split_inputs,
)
from relayrl.single_controller.resource_pool import ResourcePool, colocated, split_pool
from relayrl.single_controller.worker import ColocatedWorker, RoleSpec, Worker, WorkerInfo, construct, dp_info_from_dims

pytestmark = pytest.mark.unit


def make_batch(n: int = 5) -> DataBatch:
    return DataBatch({"x": torch.arange(n * 2).reshape(n, 2).float(), "id": torch.arange(n)},
                     meta={"temperature": 0.7}, non_tensors={"text": [f"t{i}" for i in range(n)]})


# ---------------------------------------------------------------- DataBatch


def test_batch_validates_rows():
    with pytest.raises(ValueError, match=r"rows disagree \(a: 3, b: 2"):
        DataBatch({"a": torch.zeros(3), "b": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match="rows disagree"):
        DataBatch({"a": torch.zeros(3)}, non_tensors={"t": ["x"]})
    with pytest.raises(ValueError, match="scalar"):
        DataBatch({"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        DataBatch({"a": [1, 2]})
    with pytest.raises(ValueError, match="both tensors and non_tensors"):
        DataBatch({"a": torch.zeros(1)}, non_tensors={"a": [1]})
    assert len(DataBatch()) == 0


def test_chunk_sizes_and_split_concat_roundtrip():
    assert chunk_sizes(8, 3) == [3, 3, 2]
    assert chunk_sizes(2, 4) == [1, 1, 0, 0]
    b = make_batch(5)
    parts = b.chunk(2)
    assert [len(p) for p in parts] == [3, 2]
    assert parts[1]["id"].tolist() == [3, 4] and parts[1]["text"] == ["t3", "t4"]
    assert parts[1].meta == {"temperature": 0.7}
    back = DataBatch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back["text"] == b["text"] and back.meta == b.meta
    assert [len(p) for p in b.chunk(7)] == [1, 1, 1, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="same keys"):
        DataBatch.concat([parts[0], DataBatch({"x": torch.zeros(1, 2)})])


def test_select_setitem_to():
    b = make_batch(5)
    s = b.select([4, 0])
    assert s["id"].tolist() == [4, 0] and s["text"] == ["t4", "t0"]
    m = b.select(torch.tensor([True, False, True, False, False]))
    assert m["id"].tolist() == [0, 2]
    b["logp"] = torch.ones(5, 3)
    b["score"] = [0.1] * 5
    assert set(b.keys()) == {"x", "id", "logp", "text", "score"}
    with pytest.raises(ValueError, match="has 2 rows but the batch has 5"):
        b["bad"] = torch.zeros(2)
    moved = b.to("cpu")
    assert moved["x"].device.type == "cpu" and moved["text"] == b["text"]


def test_pickled_chunk_carries_only_its_rows():
    big = DataBatch({"x": torch.zeros(1000, 100)})
    chunk = big.chunk(10)[0]
    assert chunk["x"].untyped_storage().nbytes() == big["x"].untyped_storage().nbytes()  # a view
    blob = pickle.dumps(chunk)
    assert len(blob) < len(pickle.dumps(big)) / 5
    again = pickle.loads(blob)
    assert torch.equal(again["x"], chunk["x"]) and len(again) == 100


# ---------------------------------------------------------------- dispatch

DP2_TP2 = [DPInfo(0, 2, True), DPInfo(0, 2, False), DPInfo(1, 2, True), DPInfo(1, 2, False)]


def test_dispatch_declaration():
    class W:
        @dispatch(Dispatch.DP_SPLIT)
        def f(self):
            """doc"""

        @dispatch("rank_zero")
        def g(self):
            pass

    assert dispatch_mode(W.f) is Dispatch.DP_SPLIT and dispatch_mode(W.g) is Dispatch.RANK_ZERO
    assert W.f.__doc__ == "doc"
    with pytest.raises(ValueError, match="unknown dispatch mode"):
        dispatch("scatter")


def test_dp_split_gives_tp_peers_the_same_chunk():
    b = make_batch(5)
    calls = split_inputs(Dispatch.DP_SPLIT, DP2_TP2, (b, 3), {"extra": b, "flag": True})
    assert [c[0][0]["id"].tolist() for c in calls] == [[0, 1, 2], [0, 1, 2], [3, 4], [3, 4]]
    assert calls[0] is calls[1] and calls[2] is calls[3]  # one object per dp rank: sent once
    assert all(c[0][1] == 3 and c[1]["flag"] is True for c in calls)
    assert calls[3][1]["extra"]["id"].tolist() == [3, 4]
    same = split_inputs(Dispatch.ONE_TO_ALL, DP2_TP2, (b,), {})
    assert all(c[0][0] is b for c in same)


def test_collect_outputs():
    parts = [DataBatch({"r": torch.tensor([r])}) for r in range(4)]
    out = collect_outputs(Dispatch.DP_SPLIT, DP2_TP2, parts)
    assert out["r"].tolist() == [0, 2]  # representatives only, dp order
    shuffled = [DPInfo(1, 2, True), DPInfo(0, 2, True)]
    assert collect_outputs(Dispatch.DP_SPLIT, shuffled, ["a", "b"]) == ["b", "a"]
    assert collect_outputs(Dispatch.DP_SPLIT, shuffled, [None, None]) is None
    assert collect_outputs(Dispatch.ONE_TO_ALL, DP2_TP2, [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert collect_outputs(Dispatch.RANK_ZERO, DP2_TP2, [1, 2, 3, 4]) == 1


def test_check_layout():
    check_layout(DP2_TP2)
    with pytest.raises(ValueError, match="different dp_size"):
        check_layout([DPInfo(0, 2), DPInfo(0, 1)])
    with pytest.raises(ValueError, match="exactly one representative"):
        check_layout([DPInfo(0, 2, True), DPInfo(1, 2, False)])
    with pytest.raises(ValueError, match="outside"):
        check_layout([DPInfo(3, 2)])


def test_dp_info_from_dims_matches_mesh_order():
    dims = ParallelDims(dp_shard=2, tp=2, world_size=4)  # tp fastest
    assert [dp_info_from_dims(r, dims) for r in range(4)] == DP2_TP2


# ---------------------------------------------------------------- pools and placement


def test_resource_pool_and_split():
    pool = ResourcePool([4, 4], device="cuda")
    assert pool.world_size == 8 and pool.locate(5) == (1, 1) and pool.device_for(5) == "cuda:1"
    parts = split_pool(pool, {"actor": 6, "rollout": 2})
    assert parts["actor"].processes_per_node == [4, 2] and parts["actor"].node_ids == [0, 1]
    assert parts["rollout"].processes_per_node == [2] and parts["rollout"].node_ids == [1]
    assert [parts["rollout"].device_for(r) for r in range(2)] == ["cuda:2", "cuda:3"]
    assert ResourcePool([2]).device_for(1) == "cpu"
    with pytest.raises(ValueError, match="at most"):
        split_pool(pool, {"actor": 6, "rollout": 3})
    with pytest.raises(ValueError, match="processes_per_node"):
        ResourcePool([0])
    shared = colocated(pool, ["actor", "rollout"])
    assert shared["actor"] is shared["rollout"] is pool


# ---------------------------------------------------------------- workers in one process


class Echo(Worker):
    def __init__(self, tag: str = ""):
        self.seen_rank = self.rank  # rank info is there before __init__ runs
        self.tag = tag


def test_construct_injects_info_and_standalone_is_rank0_of_1():
    w = construct(Echo, WorkerInfo(rank=3, world_size=4, store=StoreAddress("10.0.0.7", 1234, "t")), ("a",))
    assert (w.seen_rank, w.world_size, w.master_addr, w.tag) == (3, 4, "10.0.0.7", "a")
    solo = Echo()
    assert (solo.rank, solo.world_size) == (0, 1) and solo.dp_info() == DPInfo(0, 1, True)
    with pytest.raises(RuntimeError, match="has no rendezvous address: it was built directly"):
        solo.init_distributed()


def test_colocated_worker_hosts_roles():
    info = WorkerInfo(rank=1, world_size=2)
    w = construct(ColocatedWorker, info, (), {"roles": {"actor": (Echo, ("x",)), "reward": Echo}})
    assert w.actor.tag == "x" and w.actor.rank == 1 and w.reward.rank == 1
    assert ColocatedWorker.group_interface({"actor": Echo}) == {"": ColocatedWorker, "actor": Echo}
    with pytest.raises(ValueError, match="role name 'teardown'"):
        construct(ColocatedWorker, info, (), {"roles": {"teardown": Echo}})
    with pytest.raises(TypeError, match="a role is a class"):
        RoleSpec.of("actor")
    w.teardown()
    assert not hasattr(w, "actor")
