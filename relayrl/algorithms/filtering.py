"""This module selects the prompt groups that carry a learning signal (DAPO dynamic sampling).

With group-relative advantages, a group whose G rewards are all equal (all solved, all failed)
has advantage 0 for every sample: it costs a forward/backward and contributes nothing but a
smaller effective batch. DAPO keeps only groups with reward spread and samples more prompts
until the batch is full; the driver does the resampling, these functions do the selection.
Groups are contiguous: rewards[g*G:(g+1)*G] (the layout of advantages.py).

It imports torch only; it must never import another relayrl layer: the algorithms are a leaf, which the
trainer and the controller import.
"""

from __future__ import annotations

import torch
from torch import Tensor

SIGNAL_TOL = 1e-8


def group_has_signal(rewards: Tensor, group_size: int) -> Tensor:
    """[num_groups] bool: True where max - min of the group's rewards exceeds 1e-8."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} are not a whole number of groups of {group_size}")
    g = rewards.view(-1, group_size)
    return (g.max(dim=1).values - g.min(dim=1).values) > SIGNAL_TOL


def no_signal_fraction(rewards: Tensor, group_size: int) -> float:
    """Share of groups whose rewards are all equal (a metric worth logging every step)."""
    has = group_has_signal(rewards, group_size)
    return 0.0 if has.numel() == 0 else 1.0 - has.float().mean().item()


def select_signal_groups(rewards: Tensor, group_size: int) -> Tensor:
    """LongTensor of sample indices (in order) belonging to groups with signal.

    Whole groups are kept together, so the result indexes a batch that still has the contiguous
    group layout: rewards[idx] can go straight into an advantage estimator with the same G.
    """
    has = group_has_signal(rewards, group_size)
    groups = torch.nonzero(has, as_tuple=False).flatten()
    offsets = torch.arange(group_size, device=rewards.device)
    return (groups[:, None] * group_size + offsets[None, :]).reshape(-1).to(torch.long)
