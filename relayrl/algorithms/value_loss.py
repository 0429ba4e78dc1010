"""This module computes the critic's loss: the clipped value regression of PPO.

    loss_t = 0.5 * max( (V_t - R_t)^2, (clip(V_t, V_old_t - c, V_old_t + c) - R_t)^2 )    (c: algo.value_clip)
    loss   = token mean of loss_t over the model's tokens              (without a clip: 0.5 (V_t - R_t)^2)

R_t are the GAE returns (relayrl.algorithms.gae), V_old_t the critic's values when the batch was
collected. Clipping keeps one update from moving a value further than c from where it started, as the
policy's ratio clip does for probabilities (verl's `compute_value_loss`, OpenRLHF's `ValueLoss`).
Denominators are given by the caller (global token counts) so micro-batches accumulate exactly.

    critic/clip_frac           share of tokens where the clipped term is the larger (the clip binds)
    critic/explained_variance  1 - Var(R - V) / Var(R) over the model's tokens: 1 is a perfect critic,
                               0 one no better than the mean return, negative a harmful one

It imports torch and the algorithms' own modules only; it must never import another relayrl layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algorithms.aggregation import aggregate, masked_mean


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None,
               num_tokens: float | Tensor | None = None, num_seqs: float | Tensor | None = None,
               ) -> tuple[Tensor, dict[str, Tensor]]:
    """(scalar loss, detached stats) for [B, T] values; see the module docstring."""
    returns, old_values = returns.detach(), old_values.detach()
    unclipped = (values - returns) ** 2
    if clip is None:
        per_token, clipped_wins = unclipped, torch.zeros_like(unclipped)
    else:
        held = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (held - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_wins = (clipped > unclipped).to(values.dtype)
    loss = 0.5 * aggregate(per_token, mask, "token-mean",
                           num_tokens=num_tokens if num_tokens is not None else mask.sum().clamp(min=1.0),
                           num_seqs=num_seqs if num_seqs is not None else mask.shape[0])
    # per-token means of this batch: the trainer's tally weights them by tokens across micro-batches
    return loss, {"value_loss": 0.5 * masked_mean(per_token.detach(), mask),
                  "clip_frac": masked_mean(clipped_wins, mask), "value_mean": masked_mean(values.detach(), mask)}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over masked tokens (0 when the returns do not vary)."""
    m = mask > 0
    r, v = returns[m].double(), values[m].double()
    if r.numel() < 2 or float(r.var()) == 0.0:
        return 0.0
    return float(1.0 - (r - v).var() / r.var())
