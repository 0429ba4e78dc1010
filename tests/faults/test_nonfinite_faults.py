"""Non-finite never trains (issue 36, problem 3): each way a NaN or inf reached the update, or was saved, or was
blamed on the weight sync, reproduced on a tiny run and now one of: a failed sample (counted), a skipped step
(counted; K in a row stop in one line), a refused config or checkpoint (one line, nothing written), or a sync
message that names the trainer's own weights."""

from __future__ import annotations

import json
import math

import pytest
import torch

from relayrl.checkpoint import latest_valid_checkpoint, load_distributed
from relayrl.checkpoint.errors import CheckpointError
from relayrl.data import Example
from relayrl.models import CausalLM, ModelConfig, load_pretrained
from relayrl.models.config import ModelShape
from relayrl.roles.weight_sync import PlannedWeightSync, SyncVerificationError
from relayrl.sync.config import SyncConfig
from relayrl.sync.layout import TrainerLayout

from dist_harness import run_distributed
from harness import TINY, TrainRun, merged
from helpers import SYNC_CONFIGS, colocated_engine, importable, inline_policy, policy_model, scorer

pytestmark = pytest.mark.faults

# an environment whose step reward the example decides: NaN where the number's last digit is odd
ENV = '''
from relayrl.data.chat import prompt_messages

class HalfNaN:
    tools = []

    def reset(self, example):
        self.odd = int(example.answer) % 2 == 1
        return prompt_messages(example.prompt)

    def step(self, message):
        return None, (float("nan") if self.odd else float(len(message["content"]) % 3)), True, {}

class AllNaN(HalfNaN):
    def step(self, message):
        return None, float("nan"), True, {}
'''

# finite rewards so large that the group's mean and std overflow: NaN advantages, a NaN loss, every step
HUGE = '''
def huge(completion, example):
    return 3e38 if len(completion) % 2 else -3e38
'''

REWARDS = '''
import numpy as np

def odd(completion, example):
    return {"nan": float("nan"), "high": "high", "none": None, "npbool": np.bool_(True),
            "np32": np.float32(0.5), "inf": float("inf")}.get(completion, 1.0)
'''


def _metrics(run) -> list[dict]:
    return [m for m in map(json.loads, (run.run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def _finished(run, code: int) -> list[str]:
    try:
        got = run.wait(timeout=300)
    finally:
        run.kill()
    assert got == code, run.stderr()
    return run.error_lines()


@pytest.mark.parametrize("override, says", [
    ("trainer.lr=.inf", "config error: trainer.lr: Input should be a finite number (got inf)"),
    ("model.tiny.init_std=.inf", "config error: model.tiny.init_std: Input should be a finite number (got inf)"),
    ("reward.on_failure=.nan", "config error: reward.on_failure: Input should be a finite number (got nan)"),
])
def test_an_infinite_setting_is_refused_before_anything_is_written(tmp_path, override, says):
    run = TrainRun(tmp_path, TINY, [override])
    assert _finished(run, 2) == [f"relayrl: error: {says}"]
    assert not run.run_dir.exists()


def test_rewards_that_are_not_finite_numbers_fail_their_samples_and_numpys_bool_scores(tmp_path):
    with importable(tmp_path, "odd_rewards", REWARDS), \
            scorer([{"name": "odd_rewards:odd"}], workers=1, on_failure=-1.0) as s:  # through a worker process
        comps = ["nan", "high", "none", "npbool", "np32", "inf", "ok"]
        r = s.score(comps, [Example("q", "1")] * len(comps))
    assert r.per_function["odd_rewards:odd"] == [-1.0, -1.0, -1.0, 1.0, 0.5, -1.0, 1.0]
    assert r.failures == 4 and r.metrics()["reward/failures"] == 4.0
    assert all(math.isfinite(x) for x in r.rewards)


def test_an_environments_nan_reward_fails_its_episode_and_the_run_trains_finite(tmp_path):
    (tmp_path / "envs_nan.py").write_text(ENV)
    config = merged(TINY, {"data": {"task": "guess", "chat_template": "always"},
                           "env": {"name": f"{tmp_path / 'envs_nan.py'}:HalfNaN", "max_total_tokens": 200},
                           "rollout": {"prompts_per_step": 4}, "run": {"steps": 2}})
    run = TrainRun(tmp_path / "half", config)
    assert _finished(run, 0) == []
    steps = _metrics(run)
    assert len(steps) == 2
    assert sum(m["env/errors"] for m in steps) > 0  # the NaN episodes, counted
    for m in steps:
        assert all(math.isfinite(m[k]) for k in ("reward/mean", "loss", "grad_norm")), m
        assert m["skipped_nonfinite"] == 0.0

    config["env"]["name"] = f"{tmp_path / 'envs_nan.py'}:AllNaN"
    run = TrainRun(tmp_path / "all", config)
    assert _finished(run, 2) == [
        f"relayrl: error: environment '{tmp_path / 'envs_nan.py'}:AllNaN' failed on every episode of the step, e.g.: "
        f"environment '{tmp_path / 'envs_nan.py'}:AllNaN': the reward step() returned nan, expected a finite real "
        "number"]


def test_nan_losses_are_skipped_then_stop_in_one_line_and_the_last_checkpoint_is_finite(tmp_path):
    (tmp_path / "huge.py").write_text(HUGE)
    config = merged(TINY, {"reward": {"functions": [{"name": f"{tmp_path / 'huge.py'}:huge"}]},
                           "rollout": {"max_tokens": 5}, "run": {"steps": 8, "save_every": 1}})
    run = TrainRun(tmp_path, config)
    lines = _finished(run, 2)
    steps = _metrics(run)
    skipped = [m["step"] for m in steps if m["skipped_nonfinite"]]
    assert len(skipped) >= 2 and skipped == list(range(skipped[0], skipped[0] + len(skipped)))
    stop = skipped[-1] + 1  # the third in a row stops before its metrics are written
    assert lines == [f"relayrl: error: training stopped at step {stop}: the actor's loss was not finite (nan) in 3 "
                     "optimizer steps in a row (trainer.max_nonfinite_steps=3); none was applied, so the last "
                     "complete checkpoint is a good resume point: lower trainer.lr and check the rewards"]
    ckpt, skipped_ckpts = latest_valid_checkpoint(run.run_dir)
    assert ckpt is not None and ckpt.name == f"step_{stop - 1:08d}" and skipped_ckpts == []
    model = load_pretrained(run.run_dir / "base_model")
    load_distributed(ckpt, model)  # refuses a non-finite checkpoint: this one is finite
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_resume_passes_over_nan_weights_an_older_relayrl_saved_as_complete(tmp_path, monkeypatch):
    """The issue's case: NaN weights saved as COMPLETE, and --resume picked them every time."""
    from relayrl.checkpoint import distributed as ckpt_dist
    from relayrl.checkpoint import read_meta, save_distributed
    from relayrl.checkpoint.layout import COMPLETE_MARKER, META_FILE
    from relayrl.checkpoint.manifest import manifest_bytes

    config = merged(TINY, {"run": {"steps": 2, "save_every": 1}})
    run = TrainRun(tmp_path / "first", config)
    assert _finished(run, 0) == []
    ckpts = run.run_dir / "checkpoints"
    two = ckpts / "step_00000002"
    model = load_pretrained(run.run_dir / "base_model")
    optimizer = torch.optim.AdamW(model.parameters())
    extra = load_distributed(two, model, optimizer)
    with torch.no_grad():
        model.model.embed_tokens.weight[5, 3] = math.nan
    meta = {k: v for k, v in read_meta(two).items() if k == "model_dir"}
    with monkeypatch.context() as m:  # saved as an older relayrl did: unchecked, its meta.json without "finite"
        m.setattr(ckpt_dist, "first_nonfinite", lambda state: None)
        three = save_distributed(run.run_dir, 3, model, optimizer, extra, meta=meta)
    older = json.loads((three / META_FILE).read_text())
    del older["finite"]
    (three / META_FILE).write_text(json.dumps(older))
    (three / COMPLETE_MARKER).write_bytes(manifest_bytes(three))

    run = TrainRun(tmp_path / "resumed", None, ["run.steps=4"], args=["--resume", str(run.run_dir)])
    run.run_dir = ckpts.parent
    assert _finished(run, 0) == []
    assert [line for line in run.stderr().splitlines() if line.startswith("relayrl: skipping")] == [
        "relayrl: skipping checkpoint step_00000003: its weights are not finite (NaN or inf in "
        "model.embed_tokens.weight): an older relayrl saved them as complete"]
    assert [m["step"] for m in _metrics(run)][-2:] == [3, 4]  # resumed from step 2
    model = load_pretrained(run.run_dir / "base_model")
    load_distributed(ckpts / "step_00000004", model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _colocated():
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**SYNC_CONFIGS["gqa8x2"]))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    policy = inline_policy(model, torch.float32)
    engine = colocated_engine(policy, torch.float32)
    ws = PlannedWeightSync(policy, engine, shape=ModelShape.of(model.config), trainer_layout=TrainerLayout(),
                           engine_tp=1, colocated=True, engine_dtype=torch.float32, trainer_dtype=torch.float32,
                           temperature=1.0, cfg=SyncConfig())
    return policy, ws


def test_the_sync_names_the_trainers_own_nan_weights_not_the_transfer():
    policy, ws = _colocated()
    assert ws.sync()["sync/canary_gap"] < 1e-6
    with torch.no_grad():
        policy_model(policy).model.norm.weight[1] = math.nan
    with pytest.raises(SyncVerificationError) as e:
        ws.sync("before step 7")
    assert str(e.value) == (
        "weight sync verification failed after sync before step 7: the trainer's own weights are not finite (NaN or "
        "inf in model.norm.weight on trainer rank 0); the update diverged, not the transfer: lower trainer.lr")


def test_the_sync_names_weights_that_overflow_the_trainers_forward():
    policy, ws = _colocated()
    ws.sync()
    with torch.no_grad():
        for p in policy_model(policy).model.layers[0].mlp.parameters():
            p.mul_(1e30)  # finite, but gate x up overflows float32: the logits are not
    with pytest.raises(SyncVerificationError) as e:
        ws.sync("before step 2")
    peak = max(float(p.detach().abs().max()) for p in policy_model(policy).parameters())
    assert str(e.value) == (
        "weight sync verification failed after sync before step 2: the trainer's own canary logprobs are not "
        f"finite: its weights are finite but overflow its forward (the largest |weight| is {peak:.3g}); the update "
        "diverged, not the transfer: lower trainer.lr")


def _ranks_disagree(rank, world):
    """FSDP over 2 ranks: only rank 1 sees a NaN (its loss; then one weight of its shard). Both must agree."""
    from relayrl.algorithms import AlgoConfig
    from relayrl.checkpoint import save_distributed
    from relayrl.parallel.dims import ParallelDims
    from relayrl.parallel.parallelize import parallelize_model
    from relayrl.trainer.actor import Actor
    from relayrl.trainer.config import TrainerConfig
    from relayrl.trainer.nonfinite import NonFiniteGuard

    from helpers import random_train_batch

    out = {}
    dims = ParallelDims(world_size=world, dp_shard=2)
    mesh = dims.build_mesh("cpu")
    guard = NonFiniteGuard(3, dims=dims)
    out["guard"] = guard.check(math.nan if rank == 1 else 1.0, 2.0)  # only rank 1's own loss is NaN
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 eos_token_id=2, pad_token_id=0))
    model = parallelize_model(model, dims, mesh, dp_mode="fsdp")
    actor = Actor(model, TrainerConfig(lr=1e-3, micro_batch_size=4), AlgoConfig(), total_steps=3, dims=dims)
    batch = random_train_batch(8, seed=1)
    rows = batch.split(4)[rank]
    if rank == 1:
        rows = rows.replace(advantages=torch.full_like(rows.advantages, math.nan))
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    stats = actor.update(rows)
    out["skipped"] = stats["skipped_nonfinite"]
    out["unchanged"] = all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    stats = actor.update(batch.split(4)[rank])  # a finite step applies on both
    out["applied"] = stats["skipped_nonfinite"] == 0.0 and not all(
        torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    if rank == 1:
        with torch.no_grad():
            model.model.norm.weight.to_local()[0] = math.inf
    import tempfile
    d = [tempfile.mkdtemp() if rank == 0 else None]
    torch.distributed.broadcast_object_list(d, src=0)
    try:
        save_distributed(d[0], 1, model, actor.optimizer, {})
        out["save"] = "saved"
    except CheckpointError as e:
        out["save"] = str(e)
    import os
    out["written"] = os.listdir(os.path.join(d[0], "checkpoints")) if os.path.isdir(
        os.path.join(d[0], "checkpoints")) else []
    return out


def test_every_rank_agrees_to_skip_and_to_refuse_a_save():
    results = run_distributed(_ranks_disagree, 2)
    for r in results:
        assert (r["guard"], r["skipped"], r["unchanged"], r["applied"]) == ("loss", 1.0, True, True), r
        assert r["save"].startswith("refusing to save checkpoint step_00000001: its weights are not finite (NaN or "
                                    "inf in model.norm.weight on rank 1); the last complete checkpoint in "), r
        assert r["written"] == [], r
