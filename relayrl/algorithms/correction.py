"""This module corrects for the rollout engine and the trainer disagreeing on token probabilities.

Tokens are sampled by the rollout engine (pi_rollout: its kernels, its precision, maybe a stale
weight copy), but the loss's "old" policy is the trainer's recomputation pi_old. The samples are
therefore off-policy for pi_old by the per-token ratio

    w_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_logp_t - rollout_logp_t)

Two corrections, both using only the recorded rollout logprobs:

  * truncated IS (TIS): multiply each token's loss by min(w_t, cap). The cap bounds the variance
    a few tokens with tiny rollout probability could add; below the cap it is exact reweighting.
  * masked IS (MIS): drop whole sequences whose geometric-mean ratio
        rho_i = exp( (1/|y_i|) sum_t (old_logp_it - rollout_logp_it) )
    lies outside [low, high] — those sequences are too far off-policy to trust at all.

All outputs are detached: they are weights and masks, not part of the objective's gradient.

It imports torch and the algorithms' own modules only; it must never import another relayrl layer: the
algorithms are a leaf, which the trainer and the controller import.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from relayrl.algorithms.aggregation import masked_max, masked_mean


def _log_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    """old - rollout on masked tokens, 0 elsewhere (padding may hold anything)."""
    diff = (old_logp - rollout_logp).detach()
    return torch.where(mask > 0, diff, torch.zeros_like(diff))


def truncated_is_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float) -> Tensor:
    """[B, T] weights min(exp(old - rollout), cap), 0 where mask is 0.

    Computed as exp(min(log w, log cap)), which equals min(w, cap) and cannot overflow.
    """
    if cap <= 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    w = torch.exp(_log_ratio(old_logp, rollout_logp, mask).clamp(max=math.log(cap)))
    return w * (mask > 0).to(w.dtype)


def sequence_log_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    """[B] mean over masked tokens of (old - rollout); 0 for a sequence with no masked tokens."""
    lr = _log_ratio(old_logp, rollout_logp, mask)
    return (lr * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)


def masked_is_sequences(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """[B] float keep-mask: 1.0 where low <= rho_i <= high (rho_i the geometric-mean ratio), else 0.0.

    A sequence with no masked tokens has rho = 1 and is kept (it adds no loss either way).
    """
    rho = torch.exp(sequence_log_ratio(old_logp, rollout_logp, mask))
    return ((rho >= low) & (rho <= high)).to(old_logp.dtype)


def mismatch_stats(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the engine's logprobs are from the trainer's, over masked tokens (detached).

    mismatch/logp_abs_mean, mismatch/logp_abs_max:  mean / max of |old_logp - rollout_logp|
    mismatch/k3:  mean of  w - log w - 1,  w = pi_old / pi_rollout,  Schulman's k3 estimate of
                  KL(pi_rollout || pi_old) — unbiased because the tokens were sampled from
                  pi_rollout, and >= 0 token by token. The log-ratio is clamped to +-20 so one
                  wild token cannot make it inf.
    """
    lr = _log_ratio(old_logp, rollout_logp, mask)
    lr_c = lr.clamp(-20.0, 20.0)
    k3 = torch.exp(lr_c) - lr_c - 1.0
    return {
        "mismatch/logp_abs_mean": masked_mean(lr.abs(), mask),
        "mismatch/logp_abs_max": masked_max(lr.abs(), mask),
        "mismatch/k3": masked_mean(k3, mask),
    }
