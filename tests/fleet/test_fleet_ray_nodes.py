"""A fleet on a Ray cluster whose nodes join and leave (ray.cluster_utils.Cluster: a head and worker nodes, each its own
raylet, in this machine): with rollout.replicas_max the fleet grows onto a node that joins (RolloutFleet.autoscale,
room measured node by node: relayrl.single_controller.backends.ray.room); when a node leaves, the replica on it is lost
(its actor dies with the node), its requests resume on the others with every sample the one it would have been, and its
restart waits for room (no restart spent) until a node joins again. The bookkeeping alone, in CI:
tests/fleet/test_fleet_autoscale.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from relayrl.engine import SamplingParams
from relayrl.models.tokenizer import load_tokenizer
from relayrl.roles.fleet import RolloutFleet
from relayrl.roles.fleet_replicas import LOST, STARTING
from relayrl.single_controller.backends.ray import room
from relayrl.single_controller.liveness import GroupOptions
from relayrl.single_controller.resource_pool import ResourcePool

pytestmark = [pytest.mark.faults, pytest.mark.slow]  # ~40 s, ~75 s: raylets, actors' imports, two 100-step runs

PROMPTS = [[5 + i, 6, 7, 8 + i] for i in range(6)]


@pytest.fixture
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    root = Path(__file__).resolve().parents[2]
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    ray.init(address=c.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}})
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model

    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, init_std=0.3)
    return build_tiny_model(tmp_path_factory.mktemp("nodes") / "m", "0123456789+=abcdefghijklmnopqrstuvwxyz", cfg)


def until(what, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s")


def params() -> list[SamplingParams]:
    return [SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=3 + i, ignore_eos=True) for i in range(6)]


def tokens(outs):
    return [[s.token_ids for s in o.samples] for o in outs]


def join(fleet: RolloutFleet, r: int) -> None:
    fleet.slots[r].starting.result(timeout=120)  # placed, and its engine built
    assert fleet.maintain() == [r]
    fleet.joined(r)  # its weights are the model directory's, as every replica's here (a run's sync verifies them)


def test_the_fleet_grows_onto_a_node_that_joins_and_waits_for_one_when_its_node_leaves(cluster, model_dir):
    pool = ResourcePool([1], cpus_per_process=1.0)  # a rollout worker's: a whole CPU (rollout.replica_cpus)
    notices: list[str] = []
    fleet = RolloutFleet.own_processes(1, model_dir, {"num_blocks": 128, "seed": 0},
                                       GroupOptions(backend="ray", threads=1, heartbeat_timeout_s=5.0),
                                       load_tokenizer(model_dir), block_size=16, max_restarts=1, replicas_max=2,
                                       cpus_per_replica=1.0)
    fleet.notice = notices.append
    try:
        want = fleet.generate(PROMPTS, params())
        assert room(pool) == 0 and fleet.autoscale() is None  # the head's one CPU holds replica 0
        node = cluster.add_node(num_cpus=1)
        until(lambda: room(pool) == 1)
        assert fleet.autoscale() == 1 and fleet.slots[1].state == STARTING
        join(fleet, 1)
        assert room(pool) == 0 and fleet.autoscale() is None  # the ceiling, and no room either
        fleet.reset_stats()
        assert tokens(fleet.generate(PROMPTS, params())) == tokens(want)
        assert [fleet.router.counters[r].requests for r in range(2)] == [3, 3]  # both serve

        cluster.remove_node(node)  # replica 1's node leaves: its actor dies with it
        fleet.reset_stats()
        assert tokens(fleet.generate(PROMPTS, params())) == tokens(want)  # none lost, none duplicated
        slot = fleet.slots[1]
        assert slot.state == LOST and slot.waiting and slot.restarts == 0
        assert "rollout replica 1 waits for room on the cluster to restart (looked for at each sync)" in notices
        assert fleet.maintain() == [] and slot.state == LOST  # no node: still waiting

        cluster.add_node(num_cpus=1)  # a node joins again: the lost replica restarts on it
        until(lambda: room(pool) == 1)
        fleet.maintain()
        assert slot.restarts == 1 and not slot.waiting
        join(fleet, 1)
        fleet.reset_stats()
        assert tokens(fleet.generate(PROMPTS, params())) == tokens(want)
        assert fleet.serving == [0, 1] and fleet.router.counters[1].requests == 3
    finally:
        fleet.close()


def test_a_training_run_grows_its_fleet_onto_a_node_that_joins_and_trains_as_one_engine(tmp_path, monkeypatch,
                                                                                       cluster, model_dir):
    """The whole run (relayrl train's loop: the fleet grown between two steps by relayrl.jobs.fleet_control): a run
    of 1 replica with rollout.replicas_max 2 on a cluster with no room for a second; a node joins once the fleet is
    built; the second replica starts, joins at a sync verified at the step's version and serves, and the run's samples
    and step metrics are those of one engine in a rollout worker on local processes."""
    import json

    from relayrl.jobs.train import train

    from helpers import assert_same_metrics, cfg_for, step_metrics

    built = RolloutFleet.own_processes.__func__

    def own_processes(cls, *args, **kwargs):  # the fleet is up: now a node with room for one more replica joins
        fleet = built(cls, *args, **kwargs)
        cluster.add_node(num_cpus=1)
        return fleet

    def run(name: str, **sections):
        cfg = cfg_for(tmp_path, name, algo={"kl_coef": 0.05},
                      reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]},
                      run={"steps": 100, "save_every": 0, "samples_every": 1, "samples_per_step": 16}, **sections)
        run_dir = Path(train(cfg, show_progress=False)["run_dir"])
        rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
        return step_metrics(run_dir), [r for r in rows if r["split"] == "train"]

    worker = {"placement": "disaggregated", "rollout_worker": True}
    one, one_samples = run("local1", parallel={"backend": "local", **worker})
    # the head's 1 CPU: the trainer's actors (0.1 each) and replica 0's rollout worker (rollout.replica_cpus 0.6);
    # a replica's build on the new node spans ~50 of the 100 steps
    monkeypatch.setattr(RolloutFleet, "own_processes", classmethod(own_processes))
    got, samples = run("ray_grow", parallel={"backend": "ray", **worker},
                       rollout={"replicas": 1, "replicas_max": 2, "replica_cpus": 0.6})
    grown = [m for m in got if m["fleet/replicas"] == 2]
    assert grown, [m["fleet/replicas"] for m in got]  # it joined before the run's end
    first = grown[0]
    assert first["fleet/joined"] == 1 and first["fleet/replica1/version"] == first["step"]
    assert first["fleet/replica1/canary_gap"] <= 1e-3
    assert first["fleet/replica1/sync_bytes"] == first["sync/bytes_per_replica"]
    assert all(m["fleet/replicas"] == 2 for m in got[got.index(first):])
    assert sum(m.get("fleet/replica1/requests", 0) for m in grown) > 0  # it served
    assert samples == one_samples
    assert_same_metrics(got, one)
