"""`relayrl sft`'s evaluations give TRL reward functions the SFT's own trainer state, as `relayrl train`'s do: the
updates done (0 before the first, sft.steps after the last), sft.steps as max_steps, and the epochs of training
examples drawn by then (batches of sft.batch_size), where before every field read 0."""

from __future__ import annotations

import json

import pytest

from relayrl.jobs.sft import SFTJobConfig, run_sft

pytestmark = pytest.mark.e2e

STEPS, BATCH, N_TRAIN, N_EVAL = 3, 8, 16, 4


def test_sft_evaluations_pass_the_sft_step_and_steps_to_trl_rewards(tmp_path):
    log = tmp_path / "calls.jsonl"
    cfg = SFTJobConfig.from_dict({
        "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}},
        "data": {"task": "arith", "n_train": N_TRAIN, "n_eval": N_EVAL},
        "reward": {"functions": [{"name": "task"},
                                 {"name": "tests.fixtures.rewards:trainer_log", "params": {"log": str(log)}}]},
        "trainer": {"lr": 1e-3, "micro_batch_size": 8},
        "eval": {"max_tokens": 3},
        "sft": {"steps": STEPS, "batch_size": BATCH, "out_dir": str(tmp_path / "sft"), "tensorboard": False}})
    run_sft(cfg, show_progress=False)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2 * N_EVAL and all(c["n"] == 1 for c in calls)  # one call per held-out prompt, twice
    # before the first update: nothing drawn; after 3 updates of 8 examples over 16: one pass and a half
    # (epoch 1, position 8), and the run draws ceil(3 * 8 / 16) = 2 passes
    expected = [(0, STEPS, 0.0, 2)] * N_EVAL + [(STEPS, STEPS, 1.5, 2)] * N_EVAL
    assert sorted((c["global_step"], c["max_steps"], c["epoch"], c["num_train_epochs"]) for c in calls) == expected
