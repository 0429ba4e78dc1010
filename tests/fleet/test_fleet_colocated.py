"""A colocated fleet: with the trainer on W local ranks and rollout.tp t, replica k's engine ranks live in trainer ranks
k*t..k*t+t-1 (relayrl.roles.fleet_colocated). The same 2-step run as one engine beside the trainer in one process
(tests/e2e/test_worker_groups_run.py: FSDP 2 trains as one process does): the same samples, the same update; each
replica gets its full weights from the sharded trainer (FSDP over 2 ranks) at the step's version, exactly its shard,
part of it copied in place from the trainer rank beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.jobs.train import train
from relayrl.roles.fleet import RolloutFleet

from helpers import assert_same_metrics, cfg_for, step_metrics

pytestmark = pytest.mark.e2e

P, G = 4, 4  # helpers.SMALL's prompts per step and group size


def run(tmp_path, name: str, replicas: int, rollout_tp: int = 1, sleep_level: int = 0, **parallel):
    cfg = cfg_for(tmp_path, name, algo={"kl_coef": 0.05},
                  rollout={"replicas": replicas, "tp": rollout_tp, "sleep_level": sleep_level},
                  reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]}, parallel=parallel,
                  run={"steps": 2, "save_every": 0, "samples_every": 1, "samples_per_step": P * G})
    run_dir = Path(train(cfg, show_progress=False)["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return step_metrics(run_dir), [r for r in rows if r["split"] == "train"]


def test_two_replicas_on_two_fsdp_ranks_train_as_one_engine_in_one_process(tmp_path, monkeypatch):
    one, one_samples = run(tmp_path, "single", 1)  # the trainer and its engine in this process
    # rollout.sleep_level 2: every replica frees its KV cache and weights while the trainer updates, and gets them
    # back (restored, re-synced, verified) at the next sync
    slept = []  # (level, each replica's sleep level after it)
    sleep = RolloutFleet.sleep

    def recorded(fleet, level=1):
        sleep(fleet, level)
        slept.append((level, [role.asleep for role in fleet.replicas]))

    monkeypatch.setattr(RolloutFleet, "sleep", recorded)
    got, samples = run(tmp_path, "coloc2", 2, sleep_level=2, backend="local", placement="colocated", dp_shard=2)
    assert slept == [(2, [2, 2])] * 2  # after each step's rollout, both replicas
    assert samples == one_samples and len(samples) == 2 * P * G
    assert_same_metrics(got, one)
    for step, m in enumerate(got):
        assert m["fleet/replicas"] == 2
        assert [m[f"fleet/replica{r}/requests"] for r in range(2)] == [P / 2] * 2
        shard = m["sync/bytes_per_replica"]
        assert shard == one[step]["sync/bytes_per_engine_rank"]  # rollout.tp 1: the whole model, as one engine's
        for r in range(2):
            assert m[f"fleet/replica{r}/version"] == step + 1
            assert m[f"fleet/replica{r}/sync_bytes"] == shard  # received + copied in place: exactly its shard
            # FSDP 2: about half of it sits in the trainer rank beside it (its dim-0 chunks), the rest arrives
            assert 0.3 * shard < m[f"fleet/replica{r}/sync_bytes_copied"] < 0.7 * shard
            assert m[f"fleet/replica{r}/canary_gap"] <= 1e-3
        assert m["sync/bytes_copied_in_place"] == sum(m[f"fleet/replica{r}/sync_bytes_copied"] for r in range(2))
        assert m["sync/bytes_between_processes"] == 2 * shard - m["sync/bytes_copied_in_place"]
        # each trainer rank sends each replica the half it holds, unless that replica sits beside it: once in all
        assert m["sync/trainer_rank_bytes_sent_max"] < 0.7 * shard


@pytest.mark.slow  # ~40 s (two runs on 4 processes): the FSDP-2 case above covers a colocated fleet in CI
def test_two_tensor_parallel_replicas_on_four_trainer_ranks(tmp_path):
    """Trainer TP 2 x FSDP 2 on 4 ranks, rollout.tp 2: replica 0's engine ranks in trainer ranks 0-1, replica 1's in
    2-3, each its own TP group; each replica receives what the plan gives its 2 ranks (the embedding and the norms on
    both), part of it from the trainer ranks beside it. The same run as one colocated engine on ranks 0-1."""
    layout = dict(backend="local", placement="colocated", tp=2, dp_shard=2)
    one, one_samples = run(tmp_path, "one_tp2x2", 1, rollout_tp=2, **layout)
    got, samples = run(tmp_path, "tp2x2", 2, rollout_tp=2, **layout)
    assert samples == one_samples
    assert_same_metrics(got, one)
    for step, m in enumerate(got):
        shard = m["sync/bytes_per_replica"]
        largest = one[step]["sync/bytes_per_engine_rank"]  # one engine rank's shard: about half the model
        assert largest < shard <= 2 * largest  # its 2 ranks': the model, with the replicated pieces on both
        for r in range(2):
            assert m[f"fleet/replica{r}/version"] == step + 1
            assert m[f"fleet/replica{r}/sync_bytes"] == shard
            assert 0 < m[f"fleet/replica{r}/sync_bytes_copied"] < 0.5 * shard
            assert m[f"fleet/replica{r}/canary_gap"] <= 1e-3


@pytest.mark.slow  # ~6 s: `make bench`; the colocated run above (sleep level 2) covers a colocated fleet's sync in CI
def test_lora_adapters_alone_reach_each_colocated_replica_after_the_first_sync(tmp_path):
    """With LoRA each replica's first sync takes base + adapters, every later one the adapters alone, by its own
    plan at its offset; the same run as one engine in one process."""
    def lora_run(name: str, replicas: int, **parallel):
        cfg = cfg_for(tmp_path, name, rollout={"replicas": replicas}, parallel=parallel,
                      reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]},
                      trainer={"lora": {"rank": 4, "alpha": 8}, "lr": 1e-2}, run={"steps": 3, "save_every": 0})
        return step_metrics(Path(train(cfg, show_progress=False)["run_dir"]))

    one = lora_run("lora1", 1)
    two = lora_run("lora2", 2, backend="local", placement="colocated", dp_shard=2)
    assert_same_metrics(two, one)
    assert [m["sync/adapters_only"] for m in two] == [0.0, 1.0, 1.0]
    for step, m in enumerate(two):
        shard = m["sync/bytes_per_replica"]
        assert shard == one[step]["sync/bytes_per_engine_rank"]  # the base + adapters, then the adapters alone
        assert [m[f"fleet/replica{r}/sync_bytes"] for r in range(2)] == [shard, shard]
        assert [m[f"fleet/replica{r}/version"] for r in range(2)] == [step + 1, step + 1]
    assert two[1]["sync/bytes_per_replica"] < two[0]["sync/bytes_per_replica"] / 5
