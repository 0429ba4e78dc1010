"""This module holds the per-token estimators of KL(pi || ref) from tokens sampled from pi.

With x ~ pi and the log-ratio  l = log pi(x) - log ref(x)  (so  r = ref(x)/pi(x) = exp(-l)),
Schulman's estimators ("Approximating KL Divergence", 2020) are

    k1 = l                          unbiased, high variance, can be negative
    k2 = l^2 / 2                    biased, low variance, >= 0
    k3 = (r - 1) - log r            unbiased (E_pi[r] = 1), low variance, >= 0
       = exp(-l) + l - 1

Each is a [B, T] tensor; the caller masks and aggregates it like any other per-token loss.

Safety clamp: l is clamped to [-max_log_ratio, max_log_ratio] (20 by default) before the
estimator, so k3's exp(-l) cannot overflow to inf (inf * 0 in a masked sum would be NaN). A token
with |l| > 20 means the policies disagree by a factor above e^20 ~ 5e8 on it; the clamp caps its
penalty and zeroes its gradient, which a healthy run never reaches. Pass None to disable.

It imports torch and the algorithm registry only; it must never import another relayrl layer: the
algorithms are a leaf, which the trainer and the controller import.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algorithms.registry import get_kl, register_kl


@register_kl("k1")
def k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


@register_kl("k2")
def k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


@register_kl("k3")
def k3(log_ratio: Tensor) -> Tensor:
    return torch.exp(-log_ratio) + log_ratio - 1.0


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str, max_log_ratio: float | None = 20.0) -> Tensor:
    """Per-token KL(pi || ref) estimate [B, T] of the named kind ("k1", "k2", "k3")."""
    log_ratio = logp - ref_logp
    if max_log_ratio is not None:
        log_ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio)
    return get_kl(kind)(log_ratio)
