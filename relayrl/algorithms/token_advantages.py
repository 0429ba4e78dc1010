"""This module computes REINFORCE++ advantages (Hu, 2025): token-level, critic-free, normalised over the whole batch.

    token rewards   r_t: the outcome reward on the row's last model token, minus kl_coef * KL_t on every model
                    token (`gae.token_rewards`; KL_t is the per-token KL estimate the caller computed)
    returns         G_t = r_t + gamma * G_next(t), with no return past the last model token
    advantages      A_t = (G_t - mean) / std, mean and std over every model token of the whole batch

next(t) is the next position with mask 1, as in `gae`: prompt, padding and a multi-turn episode's observations
(mask 0) are not actions, get advantage 0, and the recursion passes over them, so an episode's turns form one
chain. The normalisation is global, not per row or per group: that is REINFORCE++'s answer to GRPO's per-prompt
normalisation, which over-fits easy prompts. REINFORCE++-baseline first subtracts from each outcome the mean
outcome of its prompt's group, then proceeds the same way.

Both are registered token-level (`advantage_is_token_level(name)` is True) with the signature

    fn(outcome [B], mask [B, T], *, group_size, kl=None, kl_coef=0.0, gamma=1.0, norm_std=True) -> [B, T]

and must be called on the whole step's batch at once (the controller's view), since the mean and std are
the batch's. The result carries no gradient; it is 0 where mask is 0.

Mapping from other frameworks:

    relayrl algo.advantage   OpenRLHF --advantage_estimator   verl algorithm.adv_estimator
    reinforce_pp             reinforce                        reinforce_plus_plus
    reinforce_pp_baseline    reinforce_baseline               reinforce_plus_plus_baseline

    `gamma` is OpenRLHF's --gamma and verl's algorithm.gamma. `kl_coef` here is the KL-*in-reward* coefficient:
    OpenRLHF's --init_kl_coef when --use_kl_loss is off, verl's algorithm.kl_ctrl.kl_coef with
    algorithm.use_kl_in_reward; in relayrl's config it is algo.kl_coef with algo.kl_in_reward: true (without
    it, kl_coef is a KL term in the loss, OpenRLHF's --use_kl_loss). gamma is algo.gamma. norm_std=False is
    OpenRLHF's --no_advantage_std_norm (mean shift only), algo.norm_std.

The std is the population std over the masked tokens with the variance clamped at 1e-8, as OpenRLHF's global
normalisation; verl's masked_whiten uses the unbiased variance, larger by n/(n-1) (0.1% in std at n = 500).
On right-padded single-turn rows the returns equal both frameworks' loops; they differ only on mask holes
inside a row (multi-turn), where OpenRLHF also discounts over the hole's positions, and verl cuts the chain
there (a turn before the hole does not see the outcome).
verl's REINFORCE++-baseline also drops the discount and folds the KL into the sequence score before
broadcasting; ours follows OpenRLHF's (per-token KL, discounted returns).

It imports torch and the algorithm modules only; it must never import another relayrl layer: the algorithms
are a leaf, which the trainer and the controller import.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algorithms.gae import token_rewards

VAR_FLOOR = 1e-8  # OpenRLHF's clamp of the variance: an all-equal batch gets advantage 0, never NaN


@torch.no_grad()
def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """[B, T] returns G_t = r_t + gamma * G_next(t) over the mask-1 positions; 0 where mask is 0."""
    if rewards.shape != mask.shape:
        raise ValueError(f"rewards and mask must have one shape, got {tuple(rewards.shape)}, {tuple(mask.shape)}")
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # no return past the last model token
    for t in reversed(range(rewards.shape[1])):
        act = mask[:, t] > 0
        g = rewards[:, t] + gamma * running
        returns[:, t] = torch.where(act, g, torch.zeros_like(g))
        running = torch.where(act, g, running)  # a mask-0 position passes the running return on unchanged
    return returns


@torch.no_grad()
def global_whiten(x: Tensor, mask: Tensor, norm_std: bool = True) -> Tensor:
    """(x - mean) / std over every masked token of the batch (population std); 0 off the mask."""
    m = (mask > 0).to(x.dtype)
    n = m.sum()
    if n == 0:  # no model tokens anywhere: nothing to normalise, and nothing the loss would read
        return torch.zeros_like(x)
    mean = (x * m).sum() / n
    out = (x - mean) * m
    if norm_std:
        var = (out**2).sum() / n
        out = out * var.clamp(min=VAR_FLOOR).rsqrt()
    return out


def _check(outcome: Tensor, mask: Tensor, kl: Tensor | None) -> Tensor:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    if kl is not None and kl.shape != mask.shape:
        raise ValueError(f"kl must have the mask's shape {tuple(mask.shape)}, got {tuple(kl.shape)}")
    outcome = outcome.detach()
    return outcome if outcome.is_floating_point() else outcome.to(torch.float32)


def reinforce_pp(outcome: Tensor, mask: Tensor, *, group_size: int = 1, kl: Tensor | None = None,
                 kl_coef: float = 0.0, gamma: float = 1.0, norm_std: bool = True) -> Tensor:
    """REINFORCE++ (OpenRLHF `reinforce`, verl `reinforce_plus_plus`): whitened discounted token returns.

    outcome [B] sequence rewards; mask [B, T] 1 on model tokens; kl [B, T] the per-token KL estimate
    (ignored off the mask, and when kl_coef is 0). group_size is accepted for a uniform signature and unused:
    the baseline is the batch mean, taken by the whitening. See the module docstring.
    """
    outcome = _check(outcome, mask, kl)
    rewards = token_rewards(outcome, mask, kl, kl_coef)
    return global_whiten(discounted_returns(rewards, mask, gamma), mask, norm_std)


def reinforce_pp_baseline(outcome: Tensor, mask: Tensor, *, group_size: int, kl: Tensor | None = None,
                          kl_coef: float = 0.0, gamma: float = 1.0, norm_std: bool = True) -> Tensor:
    """REINFORCE++-baseline (OpenRLHF `reinforce_baseline`, verl `reinforce_plus_plus_baseline`).

    outcome_i -= the mean outcome of its group (the G contiguous samples of one prompt), then REINFORCE++.
    The group mean removes the prompt's difficulty before the global whitening, without GRPO's per-group std.
    """
    outcome = _check(outcome, mask, kl)
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for reinforce_pp_baseline, got {group_size}")
    if outcome.dim() != 1 or outcome.numel() % group_size != 0:
        raise ValueError(f"outcome must be [N] with N a whole number of groups of {group_size}, "
                         f"got shape {tuple(outcome.shape)}")
    groups = outcome.view(-1, group_size)
    centred = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)
    return reinforce_pp(centred, mask, kl=kl, kl_coef=kl_coef, gamma=gamma, norm_std=norm_std)
