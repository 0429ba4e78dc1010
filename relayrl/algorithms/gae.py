"""This module computes generalised advantage estimation (GAE) on token-level rewards, for PPO with a critic.

    token rewards   r_t: the outcome reward on the last model token, minus kl_coef * KL_t on every model
                    token when the KL is put in the reward (`token_rewards`)
    values          V_t: the critic's value of each token's state
    delta_t = r_t + gamma * V_next(t) - V_t         A_t = delta_t + gamma * lam * A_next(t)
    returns_t = A_t + V_t                            (the critic's regression target)

next(t) is the next position with mask 1: the model's next token. Positions with mask 0 are not actions
(prompt, padding, and a multi-turn episode's observations between turns): they get advantage 0, and the
recursion passes over them, so an episode's turns form one chain. There is no value past the last model
token (V_next = 0, A_next = 0 there): the episode ends with its outcome.

For a verl user: `gamma` and `lam` are verl's `algorithm.gamma` / `algorithm.lam`; `masked_whiten` is
verl's whitening of the advantages (shift the mean, divide by the unbiased std over the masked tokens).
With right-padded single-turn rows the recursion is verl's `compute_gae_advantage_return` exactly.

`algo.advantage: gae` registers `gae_advantages`; the critic that produces V_t is relayrl.trainer.critic.

It imports torch only; it must never import another relayrl layer: the algorithms are a leaf, which the
trainer and the controller import.
"""

from __future__ import annotations

import torch
from torch import Tensor

WHITEN_EPS = 1e-8


def token_rewards(outcome: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """[B, T] rewards: outcome[i] on row i's last model token; minus kl_coef * kl on every model token."""
    if outcome.shape != mask.shape[:1]:
        raise ValueError(f"outcome must be [B] = [{mask.shape[0]}], got {tuple(outcome.shape)}")
    rewards = torch.zeros_like(mask, dtype=outcome.dtype)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values  # -1: a row without model tokens
    rows = (last >= 0).nonzero().flatten()
    rewards[rows, last[rows]] = outcome[rows]
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl.detach() * mask
    return rewards


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """(advantages, returns), both [B, T] and 0 where mask is 0; see the module docstring."""
    if not (rewards.shape == values.shape == mask.shape):
        raise ValueError(f"rewards, values and mask must have one shape, got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(mask.shape)}")
    values = values.detach()
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        act = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(act, adv, torch.zeros_like(adv))
        next_value = torch.where(act, values[:, t], next_value)
        next_adv = torch.where(act, adv, next_adv)
    returns = (advantages + values) * (mask > 0)
    return advantages, returns


def gae_advantages(outcome: Tensor, mask: Tensor, *, values: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0,
                   gamma: float = 1.0, lam: float = 1.0, whiten: bool = True) -> tuple[Tensor, Tensor]:
    """(advantages, returns) [B, T] of PPO with a critic: token rewards (outcome on the last model token, minus
    kl_coef * KL per token), GAE over the critic's values, the advantages whitened over the batch's model tokens."""
    adv, returns = gae(token_rewards(outcome, mask, kl, kl_coef), values, mask, gamma, lam)
    return (masked_whiten(adv, mask) if whiten else adv), returns


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / std over the masked tokens (unbiased std), or x / std without the shift; 0 off the mask."""
    m = (mask > 0).to(x.dtype)
    n = m.sum()
    if n < 2:
        raise ValueError("whitening needs at least two masked tokens")
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / (n - 1)
    out = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return out * m
