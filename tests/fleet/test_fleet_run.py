"""The issue's test: a 2-step run on 1, 2 and 4 engine replicas (each in a rollout worker process of its own, behind
the router) gives the same samples and the same step metrics as one engine, since every request carries its own seed;
each replica holds the step's weights version after its sync, and receives exactly its shard."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from relayrl.jobs.train import train

from helpers import assert_same_metrics, cfg_for, step_metrics

pytestmark = pytest.mark.e2e

FLEET = {"backend": "local", "placement": "disaggregated", "rollout_worker": True}
P, G = 4, 4  # helpers.SMALL's prompts per step and group size


def run(tmp_path, replicas: int):
    cfg = cfg_for(tmp_path, f"replicas{replicas}", algo={"kl_coef": 0.05}, rollout={"replicas": replicas},
                  reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]}, parallel=FLEET,
                  run={"steps": 2, "save_every": 0, "samples_every": 1, "samples_per_step": P * G})
    run_dir = Path(train(cfg, show_progress=False)["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return step_metrics(run_dir), [r for r in rows if r["split"] == "train"]


def model_bytes(run_dir: Path) -> int:
    """The fp32 bytes of every tensor of the run's model file (a tied head is stored once, and synced once)."""
    from safetensors.torch import load_file

    return sum(t.numel() * 4 for t in load_file(run_dir / "base_model" / "model.safetensors").values())


@pytest.mark.parametrize("replicas", [(2,), pytest.param((2, 4), marks=pytest.mark.slow)], ids=["2", "2-4"])
def test_a_run_on_1_2_and_4_replicas_samples_and_trains_as_one_engine(tmp_path, replicas):
    """CI runs 1 against 2 replicas; `make bench` 1 against 2 and 4."""
    one, one_samples = run(tmp_path, 1)
    assert len(one_samples) == 2 * P * G
    for n in replicas:
        got, samples = run(tmp_path, n)
        assert samples == one_samples  # every prompt, completion, reward and advantage of both steps
        assert_same_metrics(got, one)
        for step, m in enumerate(got):
            assert m["fleet/replicas"] == n
            # routing: P prompts of a few tokens (no full block to share) spread by load, P / n each
            assert [m[f"fleet/replica{r}/requests"] for r in range(n)] == [P / n] * n
            tokens = sum(m[f"fleet/replica{r}/tokens"] for r in range(n))
            assert tokens == m["response_length/mean"] * P * G
            # the sync fanned out: every replica at the step's version, verified, and sent exactly its shard
            shard = m["sync/bytes_per_replica"]
            # rollout.tp 1: a replica's shard is the whole model, each tensor once
            assert shard == one[step]["sync/bytes_per_engine_rank"] == model_bytes(tmp_path / "replicas1")
            for r in range(n):
                assert m[f"fleet/replica{r}/version"] == step + 1
                assert m[f"fleet/replica{r}/sync_bytes"] == shard
                assert m[f"fleet/replica{r}/canary_gap"] <= 1e-3
            assert m["sync/bytes_between_processes"] == n * shard
            assert m["sync/trainer_rank_bytes_sent_max"] == n * shard  # one trainer rank: once per replica


@pytest.mark.slow  # ~20 s: the 1/2/4-replica test covers the fan-out in CI; `make bench` runs this
def test_lora_adapters_alone_reach_every_replica_after_the_first_sync(tmp_path):
    """With LoRA the first sync sends base + adapters, every later one the adapters alone, to each replica; with
    rollout.sleep_level 1 every replica frees its KV cache after the rollout and wakes at the sync. The same run as
    one engine."""
    def lora_run(replicas: int):
        cfg = cfg_for(tmp_path, f"lora{replicas}", rollout={"replicas": replicas, "sleep_level": 1}, parallel=FLEET,
                      reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]},
                      trainer={"lora": {"rank": 4, "alpha": 8}, "lr": 1e-2}, run={"steps": 3, "save_every": 0})
        return step_metrics(Path(train(cfg, show_progress=False)["run_dir"]))

    one, two = lora_run(1), lora_run(2)
    assert_same_metrics(two, one)
    assert [m["sync/adapters_only"] for m in two] == [0.0, 1.0, 1.0]
    for step, m in enumerate(two):
        shard = m["sync/bytes_per_replica"]
        assert shard == one[step]["sync/bytes_per_engine_rank"]  # the base + adapters, then the adapters alone
        assert [m[f"fleet/replica{r}/sync_bytes"] for r in range(2)] == [shard, shard]
        assert [m[f"fleet/replica{r}/version"] for r in range(2)] == [step + 1, step + 1]
    assert two[1]["sync/bytes_per_replica"] < two[0]["sync/bytes_per_replica"] / 5  # rank-4 adapters: a small share


@pytest.mark.slow  # ~25 s (six engine processes): `make bench` runs it
def test_replicas_of_two_tensor_parallel_ranks_each_get_their_shards(tmp_path):
    """rollout.tp 2 on 2 replicas: each rollout worker runs its engine's 2 ranks; each replica receives what the plan
    gives its 2 ranks (the model, with what every engine TP rank holds whole, the embedding and the norms
    (relayrl.sync.layout), counted on both), at the step's version."""
    cfg = cfg_for(tmp_path, "tp2", rollout={"replicas": 2, "tp": 2}, parallel=FLEET,
                  reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]},
                  run={"steps": 2, "save_every": 0})
    run_dir = Path(train(cfg, show_progress=False)["run_dir"])
    whole = model_bytes(run_dir)
    for step, m in enumerate(step_metrics(run_dir)):
        shard = m["sync/bytes_per_replica"]
        # the largest rank's shard is about half the model; the two ranks' together a little more than all of it (the
        # tiny model's replicated embedding and norms: 5.7% of it)
        assert whole / 2 <= m["sync/bytes_per_engine_rank"] < shard <= 2 * m["sync/bytes_per_engine_rank"]
        assert whole < shard < 1.1 * whole
        for r in range(2):
            assert m[f"fleet/replica{r}/sync_bytes"] == shard  # measured on the wire = the plan's
            assert m[f"fleet/replica{r}/version"] == step + 1
            assert m[f"fleet/replica{r}/canary_gap"] <= 1e-3


@pytest.mark.slow  # ~30 s (two fleet runs): `make bench`; CI covers the loss mid-rollout (tests/faults)
def test_a_replica_lost_mid_transfer_is_left_out_and_the_run_trains_as_without_the_loss(tmp_path, monkeypatch):
    """Replica 1's process is killed as its second weight sync's receive begins (the first is the evaluation's):
    its sync group is abandoned (the trainer ranks do not wait on their send to it), the other replica's transfer
    completes and is verified, the step runs on replica 0, and the run samples and trains exactly as the same run
    without the loss."""
    import os
    import signal

    from relayrl.roles.weight_sync import PlannedWeightSync

    want, want_samples = run(tmp_path, 2)
    real, seen = PlannedWeightSync.receive, []

    def killed_on_the_third_sync(self, spec):
        if self.channel == 1:
            seen.append(1)
            if len(seen) == 2:
                os.kill(self.engine.group._pids[0], signal.SIGKILL)
                time.sleep(0.5)  # dead before the call reaches it
        return real(self, spec)

    monkeypatch.setattr(PlannedWeightSync, "receive", killed_on_the_third_sync)
    cfg = cfg_for(tmp_path, "lost", algo={"kl_coef": 0.05}, rollout={"replicas": 2, "replica_restarts": 0},
                  reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]}, parallel=FLEET,
                  run={"steps": 2, "save_every": 0, "samples_every": 1, "samples_per_step": P * G})
    run_dir = Path(train(cfg, show_progress=False)["run_dir"])
    got = step_metrics(run_dir)
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [r for r in rows if r["split"] == "train"] == want_samples
    assert_same_metrics(got, want, skip=tuple(k for k in want[0] if k.startswith(("fleet/", "sync/"))))
    assert len(seen) >= 2
    hit = next(m for m in got if m["fleet/lost"] == 1)  # the step whose sync lost it: run on replica 0 alone
    assert hit["fleet/replicas"] == 1 and hit["fleet/replica0/requests"] == P and hit["sync/skipped"] == 0
    assert "fleet/replica1/sync_bytes" not in hit and hit["fleet/replica0/canary_gap"] <= 1e-3


def test_a_killed_replica_is_restarted_and_joins_at_a_sync_verified_at_the_step_s_version(tmp_path, monkeypatch):
    """In a 4-step run on 2 replicas, replica 1's process is killed as step 2's rollout begins: the step runs on
    replica 0; the restart builds beside the run and (the sync point made to wait for its build here, so that the
    join lands at step 3 whatever the machine's speed) joins at step 3's sync — the whole base by the plan, the
    fleet's version, its canary checked — and serves step 4. (The same run against one without the fault, sample
    for sample, from outside the process: tests/faults/test_fleet_run_faults.py, `make bench`.)"""
    import os
    import signal

    from relayrl.roles.fleet import RolloutFleet
    from relayrl.roles.fleet_replicas import STARTING

    real_generate, real_maintain, calls = RolloutFleet.generate, RolloutFleet.maintain, []

    def killed_on_step_2(self, prompts, params):
        calls.append(1)
        if len(calls) == 3:  # the first evaluation's, step 1's, then step 2's
            os.kill(self.replicas[1].group._pids[0], signal.SIGKILL)
            time.sleep(0.5)
        return real_generate(self, prompts, params)

    def built_first(self):
        for r in self.numbered(STARTING):
            if self.slots[r].starting is not None:
                self.slots[r].starting.result()
        return real_maintain(self)

    monkeypatch.setattr(RolloutFleet, "generate", killed_on_step_2)
    monkeypatch.setattr(RolloutFleet, "maintain", built_first)
    cfg = cfg_for(tmp_path, "killed", rollout={"replicas": 2}, parallel=FLEET,
                  reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]},
                  run={"steps": 4, "save_every": 0}, eval={"every": 0})
    ms = step_metrics(Path(train(cfg, show_progress=False)["run_dir"]))
    assert [m["fleet/replicas"] for m in ms] == [2, 1, 2, 2]
    assert ms[1]["fleet/lost"] == 1 and ms[1]["fleet/rerouted_requests"] >= 1 and ms[1]["fleet/restarts"] == 1
    assert [m["fleet/joined"] for m in ms] == [0, 0, 1, 0]
    j = ms[2]
    assert j["fleet/replica1/version"] == j["fleet/replica0/version"] == 3
    assert j["fleet/replica1/canary_gap"] <= 1e-3 and j["fleet/replica1/sync_bytes"] == j["sync/bytes_per_replica"]
    assert ms[3]["fleet/replica1/requests"] > 0 and ms[3]["fleet/replica1/version"] == 4
