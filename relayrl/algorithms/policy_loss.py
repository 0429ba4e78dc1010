"""This module holds the clipped policy-gradient losses. They share one signature, so the trainer picks
them by name:

    fn(logp, old_logp, advantages, mask, *, clip_low, clip_high, agg,
       num_tokens=None, num_seqs=None, is_weights=None, dual_clip_c=None) -> (loss scalar, stats)

    logp        [B, T]  log pi_theta(token) of the policy being trained (carries the gradient)
    old_logp    [B, T]  log pi_old(token), recomputed by the trainer before the update (no grad)
    advantages  [B] (broadcast to every token of the sequence) or [B, T]
    mask        [B, T]  1.0 on response tokens that get loss
    is_weights  [B, T]  optional per-token importance weights (rollout-mismatch correction,
                        see correction.py); detached, they rescale each token's loss

The clip range is asymmetric: [1 - clip_low, 1 + clip_high]. clip_high > clip_low is DAPO's
"clip-higher", which leaves room for low-probability tokens to grow and so delays entropy collapse.
Positions with mask 0 have their log-ratio set to 0 before exp, so garbage there (inf, huge
values at padding) cannot turn into inf * 0 = NaN; their gradient is 0 either way.

The log-ratio is clamped to [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] = [-20, 20] before exp: a token whose
old probability is below e^-88 would otherwise give exp(inf) in fp32, and inf * 0 makes the gradient
NaN even on the branch of the min that is not taken. Past the bound (a ratio beyond 4.9e8 or below
2.1e-9, far outside any clip range) the ratio is held at the bound and the token gets no gradient.

Dual-clip (Ye et al., 2020; `dual_clip_c` = c > 1, off by default): for a negative advantage the loss
of a token is also capped at -c * A, so a ratio far above 1 on a bad action cannot scale its step
without bound:  loss_t = min(-min(r A, clip(r) A), -c A)  where A < 0.

stats (detached): clip_frac = share of masked tokens where the clipped term was the active one
(clipping changed the objective); ratio_mean / ratio_max of the ratios the loss used.

It imports torch and the algorithms' own modules only; it must never import another relayrl layer: the
algorithms are a leaf, which the trainer and the controller import.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algorithms.aggregation import aggregate, masked_max, masked_mean
from relayrl.algorithms.registry import register_loss


def _token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.dim() == 1:
        return advantages[:, None].expand_as(like)
    if advantages.shape != like.shape:
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(like.shape)}, got {tuple(advantages.shape)}")
    return advantages


LOG_RATIO_BOUND = 20.0


def _clipped_surrogate(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float,
                       dual_clip_c: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token  -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), where clipping won, and
    (with dual_clip_c) where the dual clip's cap -c * A won for A < 0.

    The min picks the pessimistic term: when A > 0 the ratio gets no credit above 1 + eps_high,
    when A < 0 none below 1 - eps_low; in those regions the clipped term is constant in theta, so
    the token's gradient is 0 (and so under the dual clip's cap).
    """
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    clip_active = (clipped < unclipped).to(ratio.dtype)
    dual_active = torch.zeros_like(clip_active)
    if dual_clip_c is not None:
        cap = -dual_clip_c * adv
        capped = (adv < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        dual_active = capped.to(ratio.dtype)
    return loss, clip_active, dual_active


def _clamped(log_ratio: Tensor) -> Tensor:
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _stats(clip_active: Tensor, dual_active: Tensor, mask: Tensor, dual_clip_c: float | None) -> dict[str, Tensor]:
    out = {"clip_frac": masked_mean(clip_active, mask).detach()}
    if dual_clip_c is not None:
        out["clip_frac_dual"] = masked_mean(dual_active, mask).detach()
    return out


def _weighted(loss: Tensor, is_weights: Tensor | None) -> Tensor:
    return loss if is_weights is None else loss * is_weights.detach()


@register_loss("ppo")
def ppo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    agg: str,
    num_tokens=None,
    num_seqs=None,
    is_weights: Tensor | None = None,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip (token-level ratios), the GRPO/DAPO policy loss.

        ratio_t = exp(logp_t - old_logp_t)
        loss_t  = -min(ratio_t A, clip(ratio_t, 1 - clip_low, 1 + clip_high) A)  [* w_t]

    aggregated with `agg` (GRPO: seq-mean-token-mean; DAPO: token-mean; Dr. GRPO: seq-mean-token-sum).
    """
    keep = mask > 0
    log_ratio = torch.where(keep, _clamped(logp - old_logp.detach()), torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    per_token, clip_active, dual_active = _clipped_surrogate(ratio, _token_advantages(advantages, logp), clip_low,
                                                             clip_high, dual_clip_c)
    loss = aggregate(_weighted(per_token, is_weights), mask, agg, num_tokens=num_tokens, num_seqs=num_seqs)
    r = ratio.detach()
    stats = {**_stats(clip_active, dual_active, mask, dual_clip_c),
             "ratio_mean": masked_mean(r, mask), "ratio_max": masked_max(r, mask)}
    return loss, stats


@register_loss("gspo")
def gspo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    agg: str,
    num_tokens=None,
    num_seqs=None,
    is_weights: Tensor | None = None,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al., 2025): clip one importance ratio per sequence.

        s_i = exp( (1/|y_i|) sum_t (logp_it - old_logp_it) )    geometric mean of token ratios

    Per token it is built as  s_it = sg[s_i] * exp(logp_it - sg[logp_it]):  the value is s_i,
    and d s_it / d logp_it = s_i, so with seq-mean-token-mean the gradient is the paper's

        grad = -(1/B) sum_i A_i s_i (1/|y_i|) sum_t grad logp_it      (unclipped sequences)

    i.e. exactly the gradient of -(1/B) sum_i s_i A_i (d s_i / d logp_it = s_i / |y_i|). The same
    form with [B, T] advantages is the paper's GSPO-token. Clipping is decided per sequence (every
    token of a sequence has the same s_it), and a clipped sequence gets no gradient.
    GSPO is naturally seq-mean-token-mean (each sequence one sample); other `agg` modes reweight
    sequences by length. Its clip ranges are ~1e3x smaller than PPO's (paper: 3e-4 / 4e-4),
    because a sequence ratio averages away per-token noise.
    stats: ratio_mean / ratio_max are over sequences with at least one masked token.
    """
    keep = mask > 0
    zeros = torch.zeros_like(logp)
    n_tokens = mask.sum(dim=-1).clamp(min=1.0)
    log_ratio = torch.where(keep, logp - old_logp.detach(), zeros)
    seq_log_ratio = _clamped((log_ratio * mask).sum(dim=-1) / n_tokens)  # [B]
    # value 0, gradient 1 w.r.t. logp: carries the token's gradient through the detached s_i
    token_grad_path = torch.where(keep, logp - logp.detach(), zeros)
    ratio = torch.exp(seq_log_ratio.detach()[:, None] + token_grad_path)  # [B, T], = s_i in value
    per_token, clip_active, dual_active = _clipped_surrogate(ratio, _token_advantages(advantages, logp), clip_low,
                                                             clip_high, dual_clip_c)
    loss = aggregate(_weighted(per_token, is_weights), mask, agg, num_tokens=num_tokens, num_seqs=num_seqs)
    seq_ratio = torch.exp(seq_log_ratio.detach())
    has_tokens = keep.any(dim=-1).to(seq_ratio.dtype)
    stats = {**_stats(clip_active, dual_active, mask, dual_clip_c),
             "ratio_mean": masked_mean(seq_ratio, has_tokens), "ratio_max": masked_max(seq_ratio, has_tokens)}
    return loss, stats
