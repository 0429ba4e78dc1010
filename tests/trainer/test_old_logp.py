"""old_logp without a recompute where it is provably the same: a one-step update takes its own forward's
logprobs, detached. Its loss, statistics (the trainer-engine mismatch too), gradients and weights equal those of
the update given recomputed logprobs; a run does it by default, in one process and in worker groups."""

from __future__ import annotations

import copy

import pytest
import torch

from relayrl.algorithms import AlgoConfig, mismatch_stats
from relayrl.controller.config import RunConfig
from relayrl.errors import ConfigError
from relayrl.jobs.train import train
from relayrl.trainer.actor import Actor
from relayrl.trainer.config import TrainerConfig

from helpers import assert_same_metrics, cfg_for, random_train_batch, step_metrics


@pytest.mark.equivalence
@pytest.mark.parametrize("padding_free", [False, True])
def test_a_one_step_update_on_its_own_logprobs_equals_the_recomputed_one(tiny_model, padding_free):
    """Micro-batches of 3 over 8 rows, shuffled: the update's forward sees other row groupings than the
    recompute's, so equal means to fp32 rounding; TIS is live (rollout logprobs off the trainer's). adam_eps 1e-3
    keeps the step proportional to gradients near 0: at 1e-8, Adam turns a rounding-sized gradient (~1e-8) into a
    step of up to lr whose size is that rounding."""
    cfg = TrainerConfig(micro_batch_size=3, padding_free=padding_free, lr=1e-2, adam_eps=1e-3)
    algo = AlgoConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=1.5)
    b = random_train_batch()
    runs = {}
    for source in ("recompute", "update"):
        m = copy.deepcopy(tiny_model)
        actor = Actor(m, cfg, algo, total_steps=1)
        recomputed = actor.compute_logprobs(b)
        g = torch.Generator().manual_seed(3)
        rollout = recomputed + 0.3 * torch.randn(recomputed.shape, generator=g) * b.response_mask
        batch = b.replace(rollout_logp=rollout, ref_logp=recomputed - 0.1 * b.response_mask,
                          old_logp=recomputed if source == "recompute" else None)
        stats = actor.update(batch)
        runs[source] = (stats, {n: p.detach().clone() for n, p in m.named_parameters()}, recomputed, rollout)
    (s_r, w_r, old, rollout), (s_u, w_u, _, _) = runs["recompute"], runs["update"]
    for k in ("loss", "clip_frac", "kl", "entropy", "ratio_mean", "ratio_max", "is/weight_mean", "grad_norm"):
        assert s_u[k] == pytest.approx(s_r[k], rel=1e-5, abs=1e-6), k
    assert s_u["ratio_max"] == 1.0 and s_u["clip_frac"] == 0.0  # pi / pi_old is exactly 1 on the only step
    assert s_u["is/weight_mean"] < 1.0  # TIS weighed pi_old / pi_rollout: the correction is live
    # the mismatch the update reports is the one the driver used to compute from the recompute
    for k, v in mismatch_stats(old, rollout, b.response_mask).items():
        assert s_u[k] == pytest.approx(float(v), rel=1e-5), k
    assert "mismatch/logp_abs_mean" not in s_r  # given old_logp, the update leaves the mismatch to the driver
    for n in w_r:  # the weights after the step: the gradients were the same
        torch.testing.assert_close(w_u[n], w_r[n], atol=1e-6, rtol=1e-5, msg=n)
    moved = max(float((w_u[n] - tiny_model.state_dict()[n]).abs().max()) for n in w_u)
    assert moved > 1e-3  # the step did move them: the comparison is not of two unchanged models


@pytest.mark.unit
@pytest.mark.parametrize(("sections", "source"), [
    ({}, "update"),  # the defaults: one PPO epoch, one mini-batch
    ({"trainer": {"mini_batches": 2}}, "recompute"),  # the second mini-batch's weights have moved
    ({"trainer": {"ppo_epochs": 2}}, "recompute"),
    ({"algo": {"old_logp": "recompute"}}, "recompute"),
    ({"algo": {"proximal": "behaviour"}}, "behaviour"),
    ({"algo": {"old_logp": "engine"}}, "engine"),
    ({"algo": {"kl_in_reward": True, "kl_coef": 0.1, "advantage": "reinforce_pp"}}, "recompute"),  # read before
    ({"trainer": {"lora": {"rank": 4, "dropout": 0.1}}}, "recompute"),  # train-mode dropout: another function
    ({"trainer": {"lora": {"rank": 4}}}, "update"),
    ({"algo": {"advantage": "gae"}}, "recompute"),  # the critic's warm-up steps have no actor update
    ({"rollout": {"mode": "async"}}, "update"),  # the proximal policy is the weights at the update: the same
])
def test_old_logp_source(sections, source):
    assert RunConfig.from_dict(sections).old_logp_source() == source


@pytest.mark.unit
@pytest.mark.parametrize(("sections", "msg"), [
    ({"algo": {"old_logp": "engine"}, "rollout": {"mode": "async"}}, "synced before every batch"),
    ({"algo": {"old_logp": "engine"}, "rollout": {"engine_dtype": "bfloat16"}}, "fp32 relayrl engine"),
    ({"algo": {"old_logp": "engine"}, "trainer": {"bf16": True}}, "an fp32 trainer"),
    ({"algo": {"old_logp": "engine", "proximal": "behaviour"}}, "drop algo.old_logp"),
    ({"algo": {"old_logp": "sometimes"}}, "old_logp"),
])
def test_bad_old_logp_settings_are_refused(sections, msg):
    with pytest.raises(ConfigError, match=msg):
        RunConfig.from_dict(sections)


def _one_step(tmp_path, name, **sections):
    """3 steps of one optimiser step each; a bf16 engine, so the trainer-engine gap is a signal (~1e-2), not the
    fp32 rounding that differs between two row groupings."""
    return cfg_for(tmp_path, name, trainer={"mini_batches": 1}, run={"steps": 3, "save_every": 0},
                   rollout={"engine_dtype": "bfloat16"}, **sections)


@pytest.mark.e2e
def test_a_run_skips_the_recompute_and_matches_one_that_does_it(tmp_path):
    reward = {"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]}
    auto = train(_one_step(tmp_path, "auto", reward=reward), show_progress=False)
    rec = train(_one_step(tmp_path, "rec", reward=reward, algo={"old_logp": "recompute"}), show_progress=False)
    a, r = step_metrics(auto["run_dir"]), step_metrics(rec["run_dir"])
    assert_same_metrics(a, r)
    for x, y in zip(a, r, strict=True):
        assert x["time/old_logp"] == 0.0 < y["time/old_logp"]
        assert "flops/old_logp" not in x and y["flops/old_logp"] > 0
        assert x["mismatch/logp_abs_mean"] > 1e-3  # bf16 rounding of the engine: a gap to measure
        for k in ("mismatch/k3", "mismatch/logp_abs_max"):
            assert x[k] == pytest.approx(y[k], rel=1e-4), k


@pytest.mark.e2e
def test_worker_groups_take_the_update_logprobs_like_one_process(tmp_path):
    """FSDP 2: each rank's micro-batches report their share of the mismatch; the tally's all-reduce makes it
    the global batch's (means weighted by tokens, the max a max), as one process computes it."""
    one = train(_one_step(tmp_path, "one"), show_progress=False)
    fsdp = train(_one_step(tmp_path, "fsdp", parallel={"backend": "local", "dp_shard": 2}), show_progress=False)
    a, b = step_metrics(one["run_dir"]), step_metrics(fsdp["run_dir"])
    assert_same_metrics(a, b)
    for x, y in zip(a, b, strict=True):
        for k in ("mismatch/k3", "mismatch/logp_abs_max"):
            assert x[k] == pytest.approx(y[k], rel=1e-4), k


@pytest.mark.e2e
def test_old_logp_engine_trains_against_the_verified_fp32_engine(tmp_path):
    """Two mini-batches (the recompute's case): the engine's fp32 logprobs stand in for it. They differ from the
    trainer's only by rounding (the canary checks every sync), so the run is the recomputing one to rounding."""
    rec = train(cfg_for(tmp_path, "rec", run={"steps": 3, "save_every": 0}), show_progress=False)
    eng = train(cfg_for(tmp_path, "eng", run={"steps": 3, "save_every": 0}, algo={"old_logp": "engine"}),
                show_progress=False)
    a, b = step_metrics(eng["run_dir"]), step_metrics(rec["run_dir"])
    assert_same_metrics(a, b)
    for x, y in zip(a, b, strict=True):
        assert x["time/old_logp"] == 0.0 < y["time/old_logp"] and "flops/old_logp" not in x
        assert x["mismatch/logp_abs_max"] == 0.0 < y["mismatch/logp_abs_max"] < 1e-5  # old_logp is the engine's
