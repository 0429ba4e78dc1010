"""The same GRPO run through worker groups (local processes, Ray) and in one process, and a run
saved on one layout resumed on another from the command line."""

from __future__ import annotations

import json

import pytest

from relayrl.cli.main import main
from relayrl.jobs.train import train

from helpers import assert_same_metrics, group_cfg, step_metrics

pytestmark = pytest.mark.e2e


def test_local_worker_groups_match_single_process(tmp_path):
    ref = train(group_cfg(tmp_path, "single"), show_progress=False)
    # every role in a worker group: actor (FSDP 2) + reference colocated, rollout, 2 reward workers
    fsdp = train(group_cfg(tmp_path, "fsdp2", backend="local", dp_shard=2, rollout_worker=True, reward_workers=2,
                           placement="disaggregated"),
                 show_progress=False)
    tp = train(group_cfg(tmp_path, "tp2_disagg", backend="local", tp=2, placement="disaggregated"), show_progress=False)
    assert_same_metrics(step_metrics(fsdp["run_dir"]), step_metrics(ref["run_dir"]))
    assert_same_metrics(step_metrics(tp["run_dir"]), step_metrics(ref["run_dir"]))


@pytest.mark.slow  # ~10 s (Ray's start): `make bench`; CI: local worker groups (above), Ray in single_controller
def test_ray_worker_groups_match_single_process(tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ref = train(group_cfg(tmp_path, "single"), show_progress=False)
        got = train(group_cfg(tmp_path, "ray_ddp2", backend="ray", dp_replicate=2, dp_mode="ddp"), show_progress=False)
        assert_same_metrics(step_metrics(got["run_dir"]), step_metrics(ref["run_dir"]))
    finally:
        ray.shutdown()


def test_resume_on_another_layout_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    common = [f"run.out_dir={out}", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
              "model.tiny.num_hidden_layers=2", "data.n_train=32", "data.n_eval=8", "rollout.prompts_per_step=4",
              "rollout.group_size=4", "rollout.max_tokens=4", "eval.max_tokens=4", "run.loggers=[]",
              "run.save_every=1"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}")
    # saved by 2 FSDP ranks, resumed by 2 TP ranks, then by one process
    assert main(["train", str(cfg), *common, "run.steps=1", "parallel.backend=local", "parallel.dp_shard=2"]) == 0
    assert main(["train", "--resume", str(out), "run.steps=2", "parallel.backend=local", "parallel.dp_shard=1",
                 "parallel.tp=2"]) == 0
    assert main(["train", "--resume", str(out), "run.steps=3", "parallel.backend=none", "parallel.tp=1"]) == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 1, 2, 2, 3, 3]  # eval, train, eval per step, continuing the count
    straight = tmp_path / "straight"
    assert main(["train", str(cfg), *[c.replace(str(out), str(straight)) for c in common], "run.steps=3"]) == 0
    assert_same_metrics(step_metrics(out), step_metrics(straight))
    assert main(["export", str(out / "checkpoints" / "step_00000003"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()
