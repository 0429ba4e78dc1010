"""The advantage half of a step: from a rollout's rewards (and, for token-level estimators, its logprobs and
the critic's values) to the advantages the update uses.

    grpo / dr_grpo / rloo      one advantage per sample from its group's rewards (relayrl.algorithms.advantages)
    remax                      the reward minus the prompt's greedy sample's reward (the rollout's baseline)
    reinforce_pp(_baseline)    token-level: token rewards (outcome on the last model token, KL per token with
                               algo.kl_in_reward), discounted returns, whitened over the whole batch
    gae                        PPO with a critic: the same token rewards, the critic's values, GAE (gamma, lam),
                               whitened over the batch's model tokens; the batch carries values and returns for
                               the critic update

It runs after the old and reference logprobs are in the batch (the KL in the reward needs them).

Like the rest of the loop's package, it reaches the layers below through their protocols; it never
imports the roles, the jobs or relayrl.cli.
"""

from __future__ import annotations

from torch import Tensor

from relayrl.algorithms import get_advantage
from relayrl.algorithms.config import AlgoConfig
from relayrl.algorithms.kl import kl_penalty
from relayrl.algorithms.registry import (
    advantage_is_token_level,
    advantage_needs_critic,
    advantage_needs_greedy_baseline,
)
from relayrl.algorithms.value_loss import explained_variance
from relayrl.observe import StageTimer
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.policy import Policy


def kl_in_reward(algo: AlgoConfig, batch: TrainBatch) -> Tensor | None:
    """The per-token KL(pi_old || ref) the reward is penalised by, when algo.kl_in_reward puts it there."""
    if not algo.kl_in_reward or batch.ref_logp is None:
        return None
    return kl_penalty(batch.old_logp, batch.ref_logp, algo.kl_kind).detach()


def compute_advantages(algo: AlgoConfig, policy: Policy, batch: TrainBatch, rewards: Tensor, group_size: int,
                       timer: StageTimer, baseline: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """(advantages [B] or [B, T], figures for the step's metrics); fills batch.values / batch.returns for gae.
    Token-level estimators see the whole step's batch at once (their whitening is over all its tokens)."""
    name, mask = algo.advantage, batch.response_mask
    fn = get_advantage(name)
    if advantage_needs_critic(name):
        with timer.stage("values"):
            values = policy.compute_values(batch)
        adv, returns = fn(rewards, mask, values=values, kl=kl_in_reward(algo, batch), kl_coef=algo.kl_coef,
                          gamma=algo.gamma, lam=algo.lam, whiten=algo.whiten_advantages)
        batch.values, batch.returns = values, returns
        tokens = mask.sum().clamp(min=1)
        return adv, {"critic/explained_variance": explained_variance(values, returns, mask),
                     "critic/values_mean": float((values * mask).sum() / tokens),
                     "critic/returns_mean": float((returns * mask).sum() / tokens)}
    if advantage_is_token_level(name):
        return fn(rewards, mask, group_size=group_size, kl=kl_in_reward(algo, batch), kl_coef=algo.kl_coef,
                  gamma=algo.gamma, norm_std=algo.norm_std), {}
    if advantage_needs_greedy_baseline(name):
        return fn(rewards, group_size, norm_std=algo.norm_std, baseline=baseline), {
            "remax/baseline_mean": float(baseline.mean())}
    return fn(rewards, group_size, norm_std=algo.norm_std), {}
