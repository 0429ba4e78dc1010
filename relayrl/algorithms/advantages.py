"""This module computes group-relative advantages: one scalar per sampled response, from its group's
rewards.

Layout: the G samples of one prompt are contiguous, so `rewards[g*G:(g+1)*G]` is group g and
`rewards.view(-1, G)` has one row per prompt. Every estimator has the signature

    fn(rewards: [N], group_size: int, norm_std: bool = True) -> advantages: [N]

so the driver can swap them by name (`estimators that ignore norm_std accept it anyway`). ReMax also takes
`baseline=` [N/G], the rewards of one greedy sample per prompt (`advantage_needs_greedy_baseline`). The
token-level estimators (REINFORCE++) live in token_advantages.py.
Rewards carry no gradient; the result is a plain tensor in the rewards' float dtype.

It imports torch and the algorithm registry only; it must never import another relayrl layer: the
algorithms are a leaf, which the trainer and the controller import.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _groups(rewards: Tensor, group_size: int, min_size: int = 1) -> Tensor:
    """[N] -> [N/G, G], checking that N is a whole number of groups."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < min_size:
        raise ValueError(f"group_size must be >= {min_size} for this estimator, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards are not a whole number of groups of {group_size}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    return rewards.view(-1, group_size)


def grpo(rewards: Tensor, group_size: int, norm_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO (Shao et al., 2024):  A_i = (r_i - mean_g r) / (std_g r + eps).

    std is the *sample* standard deviation (Bessel-corrected, torch.std's default), as in the
    GRPO papers:  std_g = sqrt( sum_j (r_j - mean)^2 / (G - 1) ).  A group whose rewards are all
    equal has std 0 and gets advantage 0 (0 / eps), never NaN. With norm_std=False this is Dr. GRPO.
    """
    g = _groups(rewards, group_size, min_size=2 if norm_std else 1)
    centered = g - g.mean(dim=1, keepdim=True)
    if norm_std:
        centered = centered / (g.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def dr_grpo(rewards: Tensor, group_size: int, norm_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Dr. GRPO (Liu et al., 2025):  A_i = r_i - mean_g r.

    Dividing by the group std up-weights prompts that are nearly always solved or nearly always
    failed (small std), a difficulty bias; Dr. GRPO drops it. norm_std is accepted and ignored.
    """
    return grpo(rewards, group_size, norm_std=False, eps=eps)


def rloo(rewards: Tensor, group_size: int, norm_std: bool = True) -> Tensor:
    """REINFORCE leave-one-out (Ahmadian et al., 2024):  A_i = r_i - (1/(G-1)) sum_{j != i} r_j.

    The baseline excludes the sample itself, so it is independent of that sample and the estimator
    stays unbiased. Computed as r_i - (S - r_i)/(G-1) with S the group sum (equivalently
    G/(G-1) * (r_i - mean_g r)). norm_std is accepted and ignored.
    """
    g = _groups(rewards, group_size, min_size=2)
    others_mean = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - others_mean).reshape(-1)


def remax(rewards: Tensor, group_size: int, norm_std: bool = True, *, baseline: Tensor) -> Tensor:
    """ReMax (Li et al., 2023):  A_i = r_i - r_greedy(prompt of i).

    baseline [N/G]: the reward of one greedy (temperature 0) response per prompt, in group order; the driver
    generates and scores it (`advantage_needs_greedy_baseline("remax")` is True). The greedy response is a
    per-prompt baseline that does not depend on the sampled ones, so the estimator stays unbiased with any G,
    including G = 1 (the paper's setting). norm_std is accepted and ignored.

    verl: `algorithm.adv_estimator: remax` (its `reward_baselines`). verl broadcasts the return-to-go of the
    token rewards; without KL in the reward that is r_i on every token, the same as this [N] advantage.
    OpenRLHF has no ReMax estimator.
    """
    g = _groups(rewards, group_size)
    baseline = baseline.detach()
    if baseline.shape != (g.shape[0],):
        raise ValueError(f"baseline must be [N/G] = [{g.shape[0]}] (one greedy reward per prompt), "
                         f"got shape {tuple(baseline.shape)}")
    return (g - baseline.to(g.dtype).unsqueeze(1)).reshape(-1)
