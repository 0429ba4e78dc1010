"""A TRL reward function that reads `completion_ids` and `trainer_state` in a real `relayrl train` run: it sees the
step that drew each batch (0-based, as GRPOTrainer's global_step: the updates done before it), the run's steps,
the epochs of prompts drawn before the batch, and the sampled ids the driver trains on, in every rollout mode,
run inline (reward.workers 0) or in the reward pool's processes."""

from __future__ import annotations

import json
import os

import pytest

from relayrl.jobs.train import train

from helpers import cfg_for, step_metrics

pytestmark = pytest.mark.e2e

STEPS, P, G, N_TRAIN, N_EVAL = 3, 4, 4, 64, 16


def _run(tmp_path, name, **sections):
    log = tmp_path / f"{name}.jsonl"
    fn = {"name": "tests.fixtures.rewards:trainer_log", "params": {"log": str(log)}}
    cfg = cfg_for(tmp_path, name, reward={"functions": [{"name": "task"}, fn], **sections.pop("reward", {})},
                  run={"steps": STEPS, "save_every": 0}, **sections)
    train(cfg, show_progress=False)
    return [json.loads(line) for line in log.read_text().splitlines()], step_metrics(cfg.run.out_dir)


@pytest.mark.parametrize("name, sections, in_process", [
    ("sync_inline", {"reward": {"workers": 0}}, True),
    ("async_pool", {"reward": {"workers": 2}, "rollout": {"mode": "async", "max_staleness": 1}}, False),
])
def test_trl_function_sees_the_step_the_ids_and_the_run(tmp_path, name, sections, in_process):
    calls, metrics = _run(tmp_path, name, **sections)
    train_calls = [c for c in calls if c["n"] == G]  # one call per prompt's group of G samples
    eval_calls = [c for c in calls if c["n"] == 1]  # the evaluation's greedy samples: distinct prompts, groups of 1
    assert len(train_calls) + len(eval_calls) == len(calls)
    assert sorted(c["global_step"] for c in train_calls) == [s for s in range(STEPS) for _ in range(P)]
    for c in calls:
        assert c["max_steps"] == STEPS and c["num_train_epochs"] == 1 and c["ints"]  # ceil(3 * 4 / 64)
    for step, m in enumerate(metrics, start=1):
        mine = [c for c in train_calls if c["global_step"] == step - 1]
        # the prompts drawn before this batch: (step - 1) batches of P, over 64 training prompts
        assert {c["epoch"] for c in mine} == {(step - 1) * P / N_TRAIN}
        lengths = [n for c in mine for n in c["lengths"]]
        assert sum(lengths) / len(lengths) == m["response_length/mean"]  # the ids the driver trains on
    # evaluations before the first step and after the last: the updates done, the prompts drawn by then
    assert sorted((c["global_step"], c["epoch"]) for c in eval_calls) == (
        [(0, 0.0)] * N_EVAL + [(STEPS, STEPS * P / N_TRAIN)] * N_EVAL)
    assert ({c["pid"] for c in calls} == {os.getpid()}) == in_process
