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
    # everything but the adapters and their step size is the GRPO demo's
    assert cfg.rollout == plain.rollout and cfg.algo == plain.algo and cfg.run == plain.run
    assert cfg.trainer.model_copy(update={"lora": None, "lr": plain.trainer.lr}) == plain.trainer


@pytest.mark.e2e
def test_lora_with_ppo_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="--lora"):
        run_demo(tmp_path, lora=True, algo="ppo")
    assert not (tmp_path / "sft").exists()  # refused before anything was written
