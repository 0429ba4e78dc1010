"""This module computes the full actor objective for one (micro-)batch: policy loss + KL penalty -
entropy bonus, with the rollout-mismatch corrections applied first.

    rollout_logp ──> MIS keep-mask [B] ──> mask_eff = mask * keep
                 └─> TIS weights [B,T] (capped w = pi_old/pi_rollout, on mask_eff)
    loss = policy_loss(logp, old_logp, A, mask_eff, is_weights=w)            (cfg.loss, cfg.agg)
         + kl_coef      * aggregate(kl_penalty(logp, ref_logp, kl_kind), mask_eff)
         - entropy_coef * aggregate(entropy, mask_eff)

Denominators: every aggregate call gets the same num_tokens / num_seqs. When the trainer splits a
batch it passes the GLOBAL counts (see aggregation.py) computed from the original masks; when they
are not given they default to this batch's ORIGINAL mask (before MIS), the same rule. So an
MIS-rejected sequence contributes 0 but still counts in the denominator: rejecting it shrinks the
loss rather than re-weighting the survivors, and the trainer never needs to know the MIS outcome
of other micro-batches to get exact gradient accumulation.

Stats (all detached 0-d tensors; token means over this batch's original mask, so the trainer
averages them over micro-batches for logging):
    loss/policy, loss/kl (0 when the KL term is off), clip_frac (clip_frac_dual with dual-clip), ratio_mean, ratio_max,
    is/masked_seq_frac (share of the B sequences MIS dropped), is/weight_mean (1 without TIS),
    kl (only when ref_logp is given), entropy (only when entropy is given).

It imports torch and the algorithms' own modules only; it must never import another relayrl layer: the
algorithms are a leaf, which the trainer and the controller import.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algorithms.aggregation import aggregate, masked_mean
from relayrl.algorithms.config import AlgoConfig
from relayrl.algorithms.correction import masked_is_sequences, truncated_is_weights
from relayrl.algorithms.kl import kl_penalty
from relayrl.algorithms.registry import get_loss


def policy_objective(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: AlgoConfig,
    *,
    rollout_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss to backpropagate and its detached stats (see the module docstring)."""
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1.0)
    if num_seqs is None:
        num_seqs = mask.shape[0]
    denoms = {"num_tokens": num_tokens, "num_seqs": num_seqs}

    keep = torch.ones(mask.shape[0], dtype=mask.dtype, device=mask.device)
    is_weights = None
    if rollout_logp is not None:
        if cfg.uses_mis:
            keep = masked_is_sequences(old_logp, rollout_logp, mask, cfg.mis_low, cfg.mis_high)
    mask_eff = mask * keep[:, None]
    if rollout_logp is not None and cfg.tis_cap is not None:
        is_weights = truncated_is_weights(old_logp, rollout_logp, mask_eff, cfg.tis_cap)

    policy_loss, pstats = get_loss(cfg.loss)(
        logp, old_logp, advantages, mask_eff,
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, agg=cfg.agg, is_weights=is_weights,
        dual_clip_c=cfg.dual_clip_c, **denoms,
    )
    total = policy_loss
    kl_loss = torch.zeros((), dtype=logp.dtype, device=logp.device)
    stats: dict[str, Tensor] = {}

    if ref_logp is not None:
        kl_tok = kl_penalty(logp, ref_logp, cfg.kl_kind)
        stats["kl"] = masked_mean(kl_tok.detach(), mask)
        if cfg.kl_coef > 0 and not cfg.kl_in_reward:  # in the reward instead (PPO with a critic): no loss term
            kl_loss = aggregate(kl_tok, mask_eff, cfg.agg, **denoms)
            total = total + cfg.kl_coef * kl_loss

    if entropy is not None:
        stats["entropy"] = masked_mean(entropy.detach(), mask)
        if cfg.entropy_coef != 0:
            total = total - cfg.entropy_coef * aggregate(entropy, mask_eff, cfg.agg, **denoms)

    weight_mean = masked_mean(is_weights, mask_eff) if is_weights is not None else logp.new_ones(())
    stats.update(
        {
            "loss/policy": policy_loss.detach(),
            "loss/kl": kl_loss.detach(),
            "clip_frac": pstats["clip_frac"],
            **({"clip_frac_dual": pstats["clip_frac_dual"]} if "clip_frac_dual" in pstats else {}),
            "ratio_mean": pstats["ratio_mean"],
            "ratio_max": pstats["ratio_max"],
            "is/masked_seq_frac": (1.0 - keep).mean().detach(),
            "is/weight_mean": weight_mean.detach(),
        }
    )
    return total, stats
