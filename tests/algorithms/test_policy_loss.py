"""Dual-clip by hand, and a log-ratio that cannot overflow: loss and gradient stay finite for any ratio."""

import math

import pytest
import torch

from relayrl.algorithms import AlgoConfig, get_loss
from relayrl.algorithms.objective import policy_objective
from relayrl.algorithms.policy_loss import LOG_RATIO_BOUND

pytestmark = pytest.mark.unit


def one_token(ratio: float, adv: float, loss: str = "ppo", **kw):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out, stats = get_loss(loss)(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), clip_low=0.2,
                                clip_high=0.28, agg="token-mean", **kw)
    out.backward()
    return float(out.detach()), float(logp.grad), stats


@pytest.mark.parametrize("loss", ["ppo", "gspo"])
def test_dual_clip_by_hand(loss):
    # A = -1, ratio 5: PPO's loss is -min(5 * -1, clip(5, 0.8, 1.28) * -1) = 5, growing with the ratio
    # (gradient d/dlogp of r*1 = r = 5); dual-clip with c = 3 caps it at -c * A = 3, constant (gradient 0)
    assert one_token(5.0, -1.0, loss)[:2] == pytest.approx((5.0, 5.0))
    value, grad, stats = one_token(5.0, -1.0, loss, dual_clip_c=3.0)
    assert (value, grad) == pytest.approx((3.0, 0.0)) and float(stats["clip_frac_dual"]) == 1.0
    # below the cap (ratio 2 -> loss 2 < 3), and for a positive advantage, nothing changes
    assert one_token(2.0, -1.0, loss, dual_clip_c=3.0)[:2] == pytest.approx((2.0, 2.0))
    assert one_token(5.0, 1.0, loss, dual_clip_c=3.0)[:2] == pytest.approx(one_token(5.0, 1.0, loss)[:2])
    assert "clip_frac_dual" not in one_token(5.0, -1.0, loss)[2]


def test_dual_clip_config_needs_c_above_one():
    from relayrl.errors import ConfigError

    with pytest.raises(ConfigError, match="dual_clip_c"):
        AlgoConfig.from_dict({"dual_clip_c": 1.0})
    assert AlgoConfig.from_dict({"dual_clip_c": 3.0}).dual_clip_c == 3.0


@pytest.mark.parametrize("loss", ["ppo", "gspo"])
@pytest.mark.parametrize("dual", [None, 3.0])
def test_extreme_log_ratios_give_finite_loss_and_gradient(loss, dual):
    # log-ratios of +-100 (a token the old policy gave e^-100): exp would overflow fp32 to inf, and inf in
    # the branch of the min not taken still makes the gradient NaN
    old = torch.tensor([[0.0, -100.0, 0.0, 100.0]])
    logp = torch.tensor([[-100.0, 0.0, 100.0, 0.0]], requires_grad=True)
    cfg = AlgoConfig.from_dict({"loss": loss, "dual_clip_c": dual, "tis_cap": None})
    for adv in (1.0, -1.0):
        total, stats = policy_objective(logp, old, torch.tensor([adv]), torch.ones(1, 4), cfg)
        total.backward()
        assert torch.isfinite(total) and torch.isfinite(logp.grad).all()
        assert float(stats["ratio_max"]) <= math.exp(LOG_RATIO_BOUND) * (1 + 1e-6)
        logp.grad = None


def test_ratios_inside_the_bound_are_untouched():
    # the bound is far outside any clip range: an ordinary update's numbers are exactly as before
    logp = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-0.6, -0.9, -2.5]])
    out, _ = get_loss("ppo")(logp, old, torch.tensor([0.7]), torch.ones(1, 3), clip_low=0.2, clip_high=0.28,
                             agg="token-mean")
    ratio = torch.exp(logp.detach() - old)
    expect = -torch.minimum(ratio * 0.7, ratio.clamp(0.8, 1.28) * 0.7).mean()
    assert float(out.detach()) == pytest.approx(float(expect), abs=1e-7)
