"""The registered advantage estimators, all with one signature:

    estimator(x: AdvantageInputs, algo: AlgoConfig) -> Advantages

    AdvantageInputs   rewards [N] (G contiguous per prompt), the loss mask [N, T], G, and what an estimator may
                      need besides: the per-token KL in the reward, the critic's values, the greedy baseline
    Advantages        [N] or [N, T] advantages, the critic's returns (gae), and the step's figures

The driver fills the inputs an estimator declares it needs (register_advantage's needs_critic,
needs_greedy_baseline) and calls estimate_advantages; the choice of formula lives here, not in the loop. The
formulas themselves are plain functions beside their tests (relayrl.algorithms.advantages, token_advantages,
gae); a user's estimator registers under its own name with this signature.

    grpo / dr_grpo / rloo      one advantage per sample from its group's rewards
    remax                      the reward minus the prompt's greedy sample's reward
    reinforce_pp(_baseline)    token-level: token rewards (outcome on the last model token, KL per token with
                               algo.kl_in_reward), discounted returns, whitened over the whole batch
    gae                        PPO with a critic: the same token rewards, the critic's values, GAE (gamma, lam),
                               whitened over the batch's model tokens; returns for the critic update

It imports torch and the algorithm modules only; it must never import another relayrl layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from relayrl.algorithms.advantages import dr_grpo, grpo, remax, rloo
from relayrl.algorithms.config import AlgoConfig
from relayrl.algorithms.gae import gae_advantages
from relayrl.algorithms.registry import get_advantage, register_advantage
from relayrl.algorithms.token_advantages import reinforce_pp, reinforce_pp_baseline
from relayrl.algorithms.value_loss import explained_variance


@dataclass
class AdvantageInputs:
    rewards: Tensor  # [N] one per sample, the G samples of a prompt contiguous
    mask: Tensor  # [N, T] 1 on the model's tokens
    group_size: int
    kl: Tensor | None = None  # [N, T] KL(old || ref) per token, with algo.kl_in_reward
    values: Tensor | None = None  # [N, T] the critic's (an estimator that needs_critic)
    baseline: Tensor | None = None  # [N / G] each prompt's greedy reward (an estimator that needs_greedy_baseline)


@dataclass
class Advantages:
    advantages: Tensor  # [N] (one per sample) or [N, T] (token-level)
    returns: Tensor | None = None  # [N, T] the critic's targets (gae)
    metrics: dict[str, float] = field(default_factory=dict)


def estimate_advantages(algo: AlgoConfig, x: AdvantageInputs) -> Advantages:
    """algo.advantage's estimator on `x` (whose optional inputs the caller filled as the estimator needs)."""
    return get_advantage(algo.advantage)(x, algo)


@register_advantage("grpo")
def _grpo(x: AdvantageInputs, algo: AlgoConfig) -> Advantages:
    return Advantages(grpo(x.rewards, x.group_size, norm_std=algo.norm_std))


@register_advantage("dr_grpo")
def _dr_grpo(x: AdvantageInputs, algo: AlgoConfig) -> Advantages:
    return Advantages(dr_grpo(x.rewards, x.group_size, norm_std=algo.norm_std))


@register_advantage("rloo")
def _rloo(x: AdvantageInputs, algo: AlgoConfig) -> Advantages:
    return Advantages(rloo(x.rewards, x.group_size, norm_std=algo.norm_std))


@register_advantage("remax", needs_greedy_baseline=True)
def _remax(x: AdvantageInputs, algo: AlgoConfig) -> Advantages:
    return Advantages(remax(x.rewards, x.group_size, norm_std=algo.norm_std, baseline=x.baseline),
                      metrics={"remax/baseline_mean": float(x.baseline.mean())})


@register_advantage("reinforce_pp", token_level=True)
def _reinforce_pp(x: AdvantageInputs, algo: AlgoConfig) -> Advantages:
    return Advantages(reinforce_pp(x.rewards, x.mask, group_size=x.group_size, kl=x.kl, kl_coef=algo.kl_coef,
                                   gamma=algo.gamma, norm_std=algo.norm_std))


@register_advantage("reinforce_pp_baseline", token_level=True)
def _reinforce_pp_baseline(x: AdvantageInputs, algo: AlgoConfig) -> Advantages:
    return Advantages(reinforce_pp_baseline(x.rewards, x.mask, group_size=x.group_size, kl=x.kl,
                                            kl_coef=algo.kl_coef, gamma=algo.gamma, norm_std=algo.norm_std))


@register_advantage("gae", token_level=True, needs_critic=True)
def _gae(x: AdvantageInputs, algo: AlgoConfig) -> Advantages:
    adv, returns = gae_advantages(x.rewards, x.mask, values=x.values, kl=x.kl, kl_coef=algo.kl_coef,
                                  gamma=algo.gamma, lam=algo.lam, whiten=algo.whiten_advantages)
    tokens = x.mask.sum().clamp(min=1)
    return Advantages(adv, returns, {"critic/explained_variance": explained_variance(x.values, returns, x.mask),
                                     "critic/values_mean": float((x.values * x.mask).sum() / tokens),
                                     "critic/returns_mean": float((returns * x.mask).sum() / tokens)})
