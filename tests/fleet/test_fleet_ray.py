"""A fleet on Ray. Disaggregated: each replica's rollout worker is a Ray actor of its own (a worker group in a placement
group of its own, so replicas may sit on different nodes). Colocated: the trainer's ranks are Ray actors and replica k's
engine ranks live in those of ranks k*tp... Either way the weight sync's gloo groups meet at the driver's store on its
node's address. The same 2-step run as on local processes (or as one engine in one process): the same samples, the
same update, every replica synced to the step's version with exactly its shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.jobs.train import train
from relayrl.roles.fleet import RolloutFleet

from helpers import assert_same_metrics, cfg_for, step_metrics

pytestmark = pytest.mark.e2e

P, G = 4, 4  # helpers.SMALL's prompts per step and group size


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    root = Path(__file__).resolve().parents[2]
    # Ray's workers import this checkout's relayrl (and tests.fixtures' reward) from the repository root
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


def run(tmp_path, name: str, replicas: int, **parallel):
    cfg = cfg_for(tmp_path, name, algo={"kl_coef": 0.05}, rollout={"replicas": replicas},
                  reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]}, parallel=parallel,
                  run={"steps": 2, "save_every": 0, "samples_every": 1, "samples_per_step": P * G})
    run_dir = Path(train(cfg, show_progress=False)["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return step_metrics(run_dir), [r for r in rows if r["split"] == "train"]


def check_fleet(got: list[dict], one: list[dict]) -> None:
    for step, m in enumerate(got):
        assert m["fleet/replicas"] == 2
        assert [m[f"fleet/replica{r}/requests"] for r in range(2)] == [P / 2] * 2
        shard = m["sync/bytes_per_replica"]
        assert shard == one[step]["sync/bytes_per_engine_rank"]  # rollout.tp 1: the whole model
        for r in range(2):
            assert m[f"fleet/replica{r}/version"] == step + 1
            assert m[f"fleet/replica{r}/sync_bytes"] == shard
            assert m[f"fleet/replica{r}/canary_gap"] <= 1e-3


@pytest.mark.slow  # ~30 s (Ray's start, 3 actors, a local run beside): tests/fleet/test_fleet_config.py checks in CI
def test_two_replicas_on_ray_train_as_one_engine_on_local_processes(tmp_path, monkeypatch, ray_cluster):
    backends: list[list[str]] = []  # each fleet's replicas' worker-group backends, as the run built them
    started = RolloutFleet.own_processes.__func__

    def own_processes(cls, *args, **kwargs):
        fleet = started(cls, *args, **kwargs)
        backends.append([role.group.backend_name for role in fleet.replicas])
        return fleet

    monkeypatch.setattr(RolloutFleet, "own_processes", classmethod(own_processes))
    fleet = {"placement": "disaggregated", "rollout_worker": True}
    one, one_samples = run(tmp_path, "local1", 1, backend="local", **fleet)
    got, samples = run(tmp_path, "ray2", 2, backend="ray", **fleet)
    assert backends == [["ray", "ray"]]  # each replica a Ray actor of its own (one engine: no fleet)
    assert samples == one_samples and len(samples) == 2 * P * G
    assert_same_metrics(got, one)
    check_fleet(got, one)
    for m in got:
        assert m["sync/bytes_between_processes"] == 2 * m["sync/bytes_per_replica"]


@pytest.mark.slow  # ~15 s (Ray's actors): tests/fleet/test_fleet_colocated.py runs the same on local processes in CI
def test_two_replicas_colocated_on_ray_actors_train_as_one_engine(tmp_path, ray_cluster):
    """Trainer FSDP 2 on 2 Ray actors, replica k's engine rank in actor k: each replica's shard half copied in place
    from the trainer rank beside it, half received from the other actor."""
    one, one_samples = run(tmp_path, "single", 1)
    got, samples = run(tmp_path, "ray_coloc2", 2, backend="ray", placement="colocated", dp_shard=2)
    assert samples == one_samples
    assert_same_metrics(got, one)
    check_fleet(got, one)
    for m in got:
        for r in range(2):
            assert 0.3 < m[f"fleet/replica{r}/sync_bytes_copied"] / m["sync/bytes_per_replica"] < 0.7
