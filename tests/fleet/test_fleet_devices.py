"""Where a fleet's replicas compute on GPUs, checked without one (the pools and device strings a run would start):
local processes take tp consecutive GPUs each after the trainer's ranks (relayrl.roles.fleet_replicas.replica_devices,
relayrl.jobs.build.engine_gpus), the rollout worker on the first and its engine's tensor-parallel ranks on the next
ones (relayrl.engine.tp_workers.WorkerRanks); a replica keeps its GPUs across restarts and one added takes the GPUs no
replica holds; on Ray each rollout worker's actor reserves a GPU per tensor-parallel rank (the bundle) and sees them
as cuda:0..; a node with fewer GPUs than rollout.tp is refused in one line."""

from __future__ import annotations

import pytest

from relayrl.controller.config import RunConfig
from relayrl.errors import ConfigError
from relayrl.jobs.build import engine_gpus
from relayrl.roles.fleet import RolloutFleet
from relayrl.roles.fleet_replicas import RETIRED, replica_devices
from relayrl.single_controller.backends.ray import bundle_of
from relayrl.single_controller.resource_pool import ResourcePool

pytestmark = pytest.mark.unit


def test_replicas_take_groups_of_tp_gpus_after_the_trainers():
    assert replica_devices(8, trainer=2, tp=2) == [2, 4, 6]  # trainer on cuda:0-1, 3 replicas of 2
    assert replica_devices(8, trainer=2, tp=4) == [2]  # cuda:2-5 (6-7 left: not a whole group)
    assert replica_devices(8, trainer=0, tp=1) == list(range(8))
    assert replica_devices(1, trainer=1, tp=1) == [0]  # a one-GPU machine: shared with the trainer
    assert replica_devices(4, trainer=3, tp=2) == [0, 2]  # no whole group after the trainer: over all of them
    with pytest.raises(ValueError, match=r"rollout.tp=4 ranks needs 4 GPUs; the node has 2"):
        replica_devices(2, trainer=1, tp=4)


def cfg(replicas: int = 3, **parallel) -> RunConfig:
    par = {"placement": "disaggregated", "rollout_worker": True, "backend": "local", "dp_shard": 2} | parallel
    return RunConfig.model_validate({"parallel": par, "rollout": {"replicas": replicas, "tp": 2}})


def test_a_runs_engine_gpus_follow_its_placement():
    assert engine_gpus(cfg(), "cuda", count=8) == [2, 4, 6]
    assert engine_gpus(cfg(), "cpu", count=8) is None
    assert engine_gpus(cfg(backend="ray"), "cuda", count=8) is None  # Ray gives each actor its GPUs
    assert engine_gpus(cfg(1, rollout_worker=False), "cuda", count=8) == [2, 4, 6]  # one engine's group: cuda:2-3
    with pytest.raises(ConfigError, match=r"^rollout.tp: an engine of rollout.tp=2 ranks needs 2 GPUs; the node has 1"):
        engine_gpus(cfg(), "cuda", count=1)


def test_a_rollout_workers_pool_and_its_tensor_parallel_ranks_sit_on_its_gpus(monkeypatch):
    from relayrl.engine import tp_workers
    from relayrl.roles import rollout_worker

    pools = []
    monkeypatch.setattr(rollout_worker.WorkerGroup, "start", staticmethod(lambda pool, *a, **k: pools.append(pool)))
    rollout_worker.RolloutRole.start_process("m", {}, None, "cuda:4", "rollout1", gpus=2)
    (pool,) = pools
    assert pool.device_for(0) == "cuda:4" and pool.gpus_per_process == 2
    assert bundle_of(pool) == {"CPU": 0.1, "GPU": 2}  # on Ray: the actor reserves both, sees them as cuda:0-1
    monkeypatch.setattr(tp_workers, "WorkerGroup", lambda pool, *a, **k: pools.append(pool))
    tp_workers.WorkerRanks(None, None, 2, device="cuda:4")  # in that worker: its engine's two ranks
    assert [pools[-1].device_for(r) for r in range(2)] == ["cuda:4", "cuda:5"]
    tp_workers.WorkerRanks(None, None, 2, device="cuda")  # a Ray actor's (or unplaced): from cuda:0
    assert [pools[-1].device_for(r) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert bundle_of(ResourcePool([2], device="cpu")) == {"CPU": 0.1}


def test_a_replica_keeps_its_place_across_restarts_and_one_added_takes_a_free_one(tmp_path):
    """The fleet's places (which GPU group a replica's process takes): spawn is told each replica's."""
    from relayrl.engine import LLMEngine
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model
    from relayrl.models.tokenizer import load_tokenizer
    from relayrl.roles.rollout_worker import RolloutRole, RolloutWorker
    from relayrl.rollout.router import Router
    from relayrl.single_controller.liveness import GroupOptions, WorkerLostError
    from relayrl.single_controller.worker_group import WorkerGroup

    model_dir = build_tiny_model(tmp_path / "m", "0123456789+=abc", TinyModelConfig(hidden_size=16,
                                                                                   intermediate_size=32,
                                                                                   num_hidden_layers=1))
    tok = load_tokenizer(model_dir)

    def build():
        return LLMEngine.from_pretrained(model_dir, num_blocks=16, block_size=16, seed=0)

    spawned: list[tuple[str, int]] = []

    def spawn(name: str, place: int):
        spawned.append((name, place))
        return WorkerGroup.start(ResourcePool([1], name=name), RolloutWorker, (build,),
                                 options=GroupOptions(backend="inline"))

    fleet = RolloutFleet([RolloutRole.inline(build, tok) for _ in range(3)], Router(3, 16), spawn=spawn,
                         max_restarts=1, notice=lambda line: None)
    try:
        assert [s.place for s in fleet.slots] == [0, 1, 2]
        fleet.lose(1, WorkerLostError("rollout1 died"))
        assert spawned == [("rollout1", 1)]  # restarted on its own GPUs
        fleet.slots[1].starting.result()
        assert fleet.maintain() == [1]
        fleet.joined(1)
        fleet.resize(2)  # the highest drained: replica 2 (place 2) leaves
        fleet.maintain()
        assert fleet.slots[2].state == RETIRED
        fleet.resize(3)  # a new replica (number 3) takes the place replica 2 left
        assert spawned[-1] == ("rollout3", 2) and fleet.slots[3].place == 2
        fleet.resize(4)  # beyond: the next place (spawn maps it onto the GPU groups, sharing them past the last)
        assert spawned[-1] == ("rollout4", 3)
    finally:
        fleet.close()


def test_rays_room_counts_whole_replicas_node_by_node(monkeypatch):
    """relayrl.single_controller.backends.ray.room over Ray's per-node free resources (faked here): a replica of
    rollout.tp=2 on cuda reserves its CPUs and 2 GPUs on one node; free resources split over nodes do not add up."""
    pytest.importorskip("ray")
    import ray._private.state as state

    from relayrl.single_controller.backends.ray import room

    nodes = {"a": {"CPU": 3.0, "GPU": 4.0}, "b": {"CPU": 8.0, "GPU": 1.0}, "c": {"CPU": 0.5, "GPU": 2.0}}
    monkeypatch.setattr(state, "available_resources_per_node", lambda: nodes)
    gpu = ResourcePool([1], device="cuda", cpus_per_process=1.0, gpus_per_process=2)
    assert room(gpu) == 2  # node a: 2 (its 4 GPUs); b: 1 GPU is not 2; c: half a CPU is not one
    assert room(ResourcePool([1], device="cpu", cpus_per_process=1.0)) == 3 + 8 + 0
    assert room(ResourcePool([2], device="cpu", cpus_per_process=1.0)) == 1 + 4 + 0  # a group of 2 on one node
    with pytest.raises(ValueError, match="one-node pools"):
        room(ResourcePool([1, 1], device="cpu"))
