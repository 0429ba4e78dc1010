"""The demo's recipes are valid run configs, and `--lora` trains adapters only (the rest of the recipe kept)."""

import pytest

from relayrl.controller.config import RunConfig
from relayrl.errors import UserError
from relayrl.jobs.demo import GRPO, recipe, run_demo


@pytest.mark.unit
def test_the_lora_recipe_is_the_grpo_recipe_with_adapters():
    _, rl, _ = recipe(None, "grpo", lora=True)
    cfg = RunConfig.from_dict({**rl, "model": {"path": "unused"}})
    assert cfg.trainer.lora is not None and cfg.trainer.lora.rank == 8 and cfg.trainer.lora.alpha == 16.0
    assert cfg.trainer.lr == 5e-4
    plain = RunConfig.from_dict({**GRPO, "model": {"path": "unused"}})
    assert plain.trainer.lora is None
    # everything but the adapters, their step size and the steps its figures were measured with is the GRPO demo's
    assert cfg.run.steps == 600 and plain.run.steps == 800
    assert cfg.rollout == plain.rollout and cfg.algo == plain.algo
    assert cfg.run.model_copy(update={"steps": plain.run.steps}) == plain.run
    assert cfg.trainer.model_copy(update={"lora": None, "lr": plain.trainer.lr}) == plain.trainer


@pytest.mark.unit
@pytest.mark.parametrize("env", [None, "calculator"])
def test_a_seed_seeds_data_model_sft_and_run_and_seed_0_is_the_recipe(env):
    from relayrl.jobs.sft import SFTJobConfig

    sft0, rl0, _ = recipe(env, "grpo")
    assert recipe(env, "grpo", seed=0) == recipe(env, "grpo")
    sft3, rl3, _ = recipe(env, "grpo", seed=3)
    s0, s3 = SFTJobConfig.from_dict(sft0), SFTJobConfig.from_dict(sft3)
    r0, r3 = (RunConfig.from_dict({**rl, "model": {"path": "unused"}}) for rl in (rl0, rl3))
    assert (s0.data.seed, s0.sft.seed, s0.model.tiny.seed, r0.data.seed, r0.run.seed) == (0, 0, 0, 0, 0)
    assert (s3.data.seed, s3.sft.seed, s3.model.tiny.seed, r3.data.seed, r3.run.seed) == (3, 3, 3, 3, 3)
    # nothing else moves: the seeded configs equal the plain ones with the seeds put back
    assert s3.model_copy(update={"data": s0.data, "sft": s0.sft, "model": s0.model}) == s0
    assert s3.model.tiny.model_copy(update={"seed": 0}) == s0.model.tiny
    assert r3.model_copy(update={"data": r0.data, "run": r0.run}) == r0


@pytest.mark.e2e
def test_lora_with_ppo_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="--lora"):
        run_demo(tmp_path, lora=True, algo="ppo")
    assert not (tmp_path / "sft").exists()  # refused before anything was written
