"""A step whose loss or gradient norm is not finite is never applied (relayrl.trainer.nonfinite): the weights and
the optimizer state stay as they were, the step is counted in skipped_nonfinite, and trainer.max_nonfinite_steps
such steps in a row stop the run in one line naming the cause and the step (issue 36: one NaN reward gave
`loss nan, grad_norm nan` and NaN weights from then on)."""

import copy
import math

import pytest
import torch

from relayrl.algorithms import AlgoConfig
from relayrl.trainer import actor as actor_module
from relayrl.trainer.actor import Actor
from relayrl.trainer.config import TrainerConfig
from relayrl.trainer.nonfinite import NonFiniteGuard, NonFiniteStepError
from relayrl.trainer.sft import SFTTrainer

from helpers import random_train_batch

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("error::UserWarning")]  # no scheduler-order warning


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _poisoned(batch, rows=(0,)):
    adv = batch.advantages.clone()
    adv[list(rows)] = math.nan
    return batch.replace(advantages=adv)


def test_a_nan_step_is_skipped_and_counted_and_a_finite_one_after_it_applies(tiny_model):
    model = copy.deepcopy(tiny_model)
    actor = Actor(model, TrainerConfig(lr=1e-3, micro_batch_size=4), AlgoConfig(), total_steps=10)
    batch = random_train_batch(8, seed=1)
    before = _weights(model)
    stats = actor.update(_poisoned(batch))
    assert stats["skipped_nonfinite"] == 1.0 and math.isnan(stats["loss"]) and math.isnan(stats["grad_norm"])
    after = _weights(model)
    assert all(torch.equal(after[n], before[n]) for n in before)  # not one weight moved
    assert all(p.grad is None for p in model.parameters())  # the NaN gradients were dropped
    assert actor.optimizer.state == {} or all(not s for s in actor.optimizer.state.values())  # Adam never stepped
    assert actor.guard.streak == 1
    stats = actor.update(batch)
    assert stats["skipped_nonfinite"] == 0.0 and math.isfinite(stats["loss"]) and actor.guard.streak == 0
    moved = _weights(model)
    assert all(torch.isfinite(w).all() for w in moved.values())
    assert any(not torch.equal(moved[n], before[n]) for n in before)


def test_a_skipped_step_leaves_the_same_weights_as_no_step_at_all(tiny_model):
    """Two mini-batches, the first poisoned: the update equals one that trained on the second alone."""
    batch = random_train_batch(8, seed=2)
    cfg = TrainerConfig(lr=1e-3, micro_batch_size=4, mini_batches=2, shuffle=False)
    a = Actor(copy.deepcopy(tiny_model), cfg, AlgoConfig(), total_steps=10)
    stats = a.update(_poisoned(batch, rows=(1,)))  # row 1 is in the first mini-batch (rows 0-3)
    assert stats["skipped_nonfinite"] == 1.0
    b = Actor(copy.deepcopy(tiny_model), cfg.model_copy(update={"mini_batches": 1}), AlgoConfig(), total_steps=10)
    # the second mini-batch alone, with the denominators it had as a mini-batch of 4 rows
    b.update(batch.select(torch.arange(4, 8)))
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=n)


def test_k_non_finite_steps_in_a_row_stop_in_one_line_naming_the_cause_and_step(tiny_model):
    actor = Actor(copy.deepcopy(tiny_model), TrainerConfig(lr=1e-3, micro_batch_size=8, max_nonfinite_steps=3),
                  AlgoConfig(), total_steps=10)
    batch = random_train_batch(8, seed=3)
    actor.update(batch)  # step 1 applies
    actor.update(_poisoned(batch))  # step 2: skipped
    actor.update(batch)  # step 3: the streak is broken
    actor.update(_poisoned(batch))  # steps 4, 5: skipped
    actor.update(_poisoned(batch))
    kept = _weights(actor.model)
    with pytest.raises(NonFiniteStepError) as e:
        actor.update(_poisoned(batch))  # step 6: the third in a row
    assert str(e.value) == (
        "training stopped at step 6: the actor's loss was not finite (nan) in 3 optimizer steps in a row "
        "(trainer.max_nonfinite_steps=3); none was applied, so the last complete checkpoint is a good resume "
        "point: lower trainer.lr and check the rewards")
    assert all(torch.equal(w, kept[n]) for n, w in _weights(actor.model).items())


def test_an_infinite_gradient_norm_is_named(tiny_model, monkeypatch):
    actor = Actor(copy.deepcopy(tiny_model), TrainerConfig(micro_batch_size=8, max_nonfinite_steps=1), AlgoConfig(),
                  total_steps=10)
    monkeypatch.setattr(actor_module, "clip_grad_norm", lambda params, clip: math.inf)
    before = _weights(actor.model)
    with pytest.raises(NonFiniteStepError, match=r"^training stopped at step 1: the actor's gradient norm was not "
                                                 r"finite \(inf\) in 1 optimizer steps in a row"):
        actor.update(random_train_batch(8, seed=4))
    assert all(torch.equal(w, before[n]) for n, w in _weights(actor.model).items())


def test_the_guard_alone():
    g = NonFiniteGuard(2, who="critic")
    assert g.check(1.0, 2.0) is None
    assert g.check(math.nan, 2.0) == "loss" and g.check(0.5, math.inf) == "gradient norm"
    assert (g.streak, g.take_skipped(), g.skipped) == (2, 2, 0)
    with pytest.raises(NonFiniteStepError, match="the critic's gradient norm was not finite"):
        g.stop_if_exhausted("gradient norm", math.inf, step=7)
    assert g.check(1.0, 1.0) is None and g.streak == 0
    with pytest.raises(ValueError):
        TrainerConfig(max_nonfinite_steps=0)


def test_sft_skips_a_non_finite_step_too(tiny_model):
    model = copy.deepcopy(tiny_model)
    sft = SFTTrainer(model, TrainerConfig(lr=1e-3, micro_batch_size=8, max_nonfinite_steps=2), total_steps=5)
    batch = random_train_batch(8, seed=5)
    with torch.no_grad():
        model.model.norm.weight[0] = math.inf  # the forward's logits go non-finite
    poisoned = _weights(model)
    out = sft.step(batch)
    assert out["skipped_nonfinite"] == 1.0 and not math.isfinite(out["sft/loss"])
    assert all(torch.equal(w, poisoned[n]) for n, w in _weights(model).items())
    with pytest.raises(NonFiniteStepError, match=r"^training stopped at step 2: the model's loss was not finite"):
        sft.step(batch)
