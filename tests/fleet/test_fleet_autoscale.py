"""A fleet that grows into a cluster's room (rollout.replicas_max; relayrl.roles.fleet_replicas
ReplicaStates.autoscale): between two steps, one replica more when the cluster has room for it (on Ray: a node joined;
relayrl.single_controller.backends.ray.room), none while one starts or a lost one waits for room; a replica lost when
the cluster has no room left (its node left) waits for room without spending a restart, and restarts once there is.
Here the cluster is a counter of free replica slots and the replicas are inline engines (the bookkeeping in a second);
the same on a Ray cluster whose nodes join and leave: tests/fleet/test_fleet_ray_nodes.py (slow)."""

from __future__ import annotations

import pytest

from relayrl.controller.config import RunConfig
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.models.tokenizer import load_tokenizer
from relayrl.roles.fleet import RolloutFleet
from relayrl.roles.fleet_replicas import JOINING, LOST, RETIRED, STARTING
from relayrl.roles.rollout_worker import RolloutRole, RolloutWorker
from relayrl.rollout.router import Router
from relayrl.single_controller.liveness import GroupOptions, WorkerLostError
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker_group import WorkerGroup

PROMPTS = [[5 + i, 6, 7, 8 + i] for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model

    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, init_std=0.3)
    return build_tiny_model(tmp_path_factory.mktemp("grow") / "m", "0123456789+=abcdefghijklmnopqrstuvwxyz", cfg)


class Cluster:
    """Free replica slots: a start reserves one (as a Ray placement group does), a node joining adds some."""

    def __init__(self, free: int = 0):
        self.free, self.started, self.fail = free, [], False

    def room(self) -> int:
        return self.free


def grow_fleet(model_dir, cluster: Cluster, replicas_max: int, restarts: int = 1):
    tok = load_tokenizer(model_dir)

    def build():
        return LLMEngine.from_pretrained(model_dir, num_blocks=64, block_size=16, seed=0)

    def spawn(name: str, place: int):  # on a thread of the fleet (spawn_anywhere, as on Ray)
        if cluster.fail:
            raise RuntimeError("the engine would not build")
        cluster.free -= 1
        cluster.started.append(name)
        return WorkerGroup.start(ResourcePool([1], name=name), RolloutWorker, (build,),
                                 options=GroupOptions(backend="inline"))

    notices: list[str] = []
    fleet = RolloutFleet([RolloutRole.inline(build, tok)], Router(1, 16), spawn=spawn, max_restarts=restarts,
                         notice=notices.append, room=cluster.room, spawn_anywhere=True, replicas_max=replicas_max)
    return fleet, notices


def params() -> list[SamplingParams]:
    return [SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3 + i) for i in range(len(PROMPTS))]


def grow_into_a_failed_start(fleet: RolloutFleet, cluster: Cluster) -> None:
    """autoscale() adds replica 1, whose engine will not build (its start fails on the fleet's thread)."""
    cluster.fail = True
    assert fleet.autoscale() == 1
    with pytest.raises(RuntimeError):
        fleet.slots[1].starting.result(timeout=60)


def tokens(outs):
    return [[s.token_ids for s in o.samples] for o in outs]


def built(fleet: RolloutFleet, r: int) -> None:
    if fleet.slots[r].starting is not None:  # (a maintain() may have found it built already)
        fleet.slots[r].starting.result(timeout=60)  # its start ran on a thread of the fleet
    assert fleet.maintain() == [r] and fleet.slots[r].state == JOINING
    fleet.joined(r)  # what the sync does once it verified the replica


@pytest.mark.faults
def test_the_fleet_grows_one_replica_at_a_time_into_the_clusters_room(model_dir):
    cluster = Cluster(free=0)
    fleet, notices = grow_fleet(model_dir, cluster, replicas_max=3)
    try:
        want = fleet.generate(PROMPTS, params())
        assert fleet.autoscale() is None and fleet.size == 1  # no room: nothing starts
        cluster.free = 5  # a node joined
        assert fleet.autoscale() == 1 and fleet.slots[1].state == STARTING and cluster.started == ["rollout1"]
        assert notices[-2:] == ["the cluster has room for another rollout replica (up to rollout.replicas_max=3)",
                                "rollout replica 1 is starting (the fleet's size: 2)"]
        assert fleet.autoscale() is None  # one at a time: none while one starts
        built(fleet, 1)
        assert fleet.autoscale() == 2
        built(fleet, 2)
        assert fleet.autoscale() is None and fleet.size == 3 and cluster.free == 3  # the ceiling
        assert fleet.status()["replicas_max"] == 3 and fleet.serving == [0, 1, 2]
        fleet.reset_stats()
        assert tokens(fleet.generate(PROMPTS, params())) == tokens(want)  # three replicas: the same samples
        assert [fleet.router.counters[r].requests for r in range(3)] == [2, 2, 2]
        fleet.resize(2)  # the command's size is the new ceiling: growth does not undo it
        assert fleet.replicas_max == 2 and fleet.maintain() == [] and fleet.slots[2].state == RETIRED
        assert fleet.autoscale() is None and fleet.size == 2
    finally:
        fleet.close()


@pytest.mark.faults
def test_a_replica_lost_with_no_room_waits_for_room_without_spending_a_restart(model_dir):
    cluster = Cluster(free=1)
    fleet, notices = grow_fleet(model_dir, cluster, replicas_max=2, restarts=1)
    try:
        want = fleet.generate(PROMPTS, params())
        assert fleet.autoscale() == 1
        built(fleet, 1)
        assert cluster.free == 0
        fleet.lose(1, WorkerLostError("rollout1 worker rank 0 died (Ray: ActorDiedError: its node left)"))
        slot = fleet.slots[1]
        assert slot.state == LOST and slot.waiting and slot.restarts == 0 and fleet.status()["waiting"] == [1]
        assert notices[-1] == "rollout replica 1 waits for room on the cluster to restart (looked for at each sync)"
        assert tokens(fleet.generate(PROMPTS, params())) == tokens(want)  # replica 0 serves meanwhile
        assert fleet.maintain() == [] and slot.state == LOST and slot.restarts == 0  # still no room: still waiting
        assert fleet.autoscale() is None  # nothing new while a lost replica waits: it comes back first
        assert notices.count(notices[-1]) == 1  # said once
        cluster.free = 1  # the node is back
        fleet.maintain()
        assert slot.state in (STARTING, JOINING) and slot.restarts == 1 and not slot.waiting
        built(fleet, 1)
        assert fleet.serving == [0, 1] and fleet.status()["restarts_total"] == 1
    finally:
        fleet.close()


@pytest.mark.faults
def test_a_start_that_failed_when_the_room_is_gone_waits_for_room_then_starts(model_dir):
    cluster = Cluster(free=1)
    fleet, notices = grow_fleet(model_dir, cluster, replicas_max=2, restarts=1)
    try:
        grow_into_a_failed_start(fleet, cluster)
        cluster.fail, cluster.free = False, 0  # its node left meanwhile: no room for the second try
        assert fleet.maintain() == []
        slot = fleet.slots[1]
        assert slot.state == LOST and slot.waiting and slot.restarts == 0  # lost, waiting: not stuck starting
        assert notices[-2:] == ["rollout replica 1 did not start: the engine would not build",
                                "rollout replica 1 waits for room on the cluster to restart (looked for at each sync)"]
        cluster.free = 1
        fleet.maintain()
        assert slot.restarts == 1 and slot.state in (STARTING, JOINING)
        built(fleet, 1)
    finally:
        fleet.close()


@pytest.mark.faults
def test_a_grown_replica_that_never_comes_up_stops_the_growth_in_one_line(model_dir):
    cluster = Cluster(free=4)
    fleet, notices = grow_fleet(model_dir, cluster, replicas_max=4, restarts=0)
    try:
        grow_into_a_failed_start(fleet, cluster)
        fleet.maintain()  # its start failed; no restarts left: retired
        assert fleet.slots[1].state == RETIRED
        assert fleet.autoscale() is None and fleet.replicas_max == 1
        assert notices[-1] == ("the fleet stops growing: replica 1, added when the cluster had room, did not "
                                      "come up (its start failed: the engine would not build)")
        assert fleet.autoscale() is None and fleet.serving == [0]
    finally:
        fleet.close()


@pytest.mark.unit
def test_replicas_max_is_refused_where_it_cannot_grow_in_one_line():
    ray = {"parallel": {"backend": "ray", "rollout_worker": True, "placement": "disaggregated"}}
    assert RunConfig.model_validate({"rollout": {"replicas": 1, "replicas_max": 4}, **ray}).rollout.replicas_max == 4
    with pytest.raises(ValueError, match=r"rollout.replicas_max=1 .*: it must be at least rollout.replicas=2"):
        RunConfig.model_validate({"rollout": {"replicas": 2, "replicas_max": 1}, **ray})
    local = {"parallel": {"backend": "local", "rollout_worker": True, "placement": "disaggregated"}}
    with pytest.raises(ValueError, match=r"set parallel.backend=ray .* `relayrl fleet RUN_DIR --replicas N`"):
        RunConfig.model_validate({"rollout": {"replicas": 2, "replicas_max": 3}, **local})


@pytest.mark.faults
def test_the_run_grows_its_fleet_between_two_steps_and_says_so_in_its_status(model_dir, tmp_path):
    """relayrl.jobs.fleet_control runs between two steps of a train run: it grows the fleet, and fleet.json shows it."""
    import json

    from relayrl.jobs.fleet_control import STATUS, fleet_control

    cluster = Cluster(free=1)
    fleet, _ = grow_fleet(model_dir, cluster, replicas_max=3)
    try:
        fleet_control(fleet, tmp_path)
        status = json.loads((tmp_path / STATUS).read_text())
        assert status["starting"] == [1] and status["size"] == 2 and status["replicas_max"] == 3
        built(fleet, 1)
        fleet_control(fleet, tmp_path)  # no room left: the same size
        status = json.loads((tmp_path / STATUS).read_text())
        assert status["serving"] == [0, 1] and status["size"] == 2 and status["waiting"] == []
    finally:
        fleet.close()
