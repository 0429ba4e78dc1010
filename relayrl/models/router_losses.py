"""This module defines the MoE routers' auxiliary losses and load statistic, on the router logits a forward
records (relayrl.models.moe.Routing), pooled over the MoE layers and the real tokens:

    load balancing (Switch Transformer, as transformers computes it for Mixtral and the Qwen MoE families):
        f_e  = (1/T) Σ_{layers, tokens} [e ∈ top-k]       the tokens sending a slot to e (Σ_e f_e = k), no gradient
        P_e  = (1/T) Σ_{layers, tokens} softmax(logits)_e  the mean router probability
        loss = E Σ_e f_e P_e                              (= k when every expert gets its share)
    router z-loss (ST-MoE): (1/T) Σ_{layers, tokens} logsumexp(logits)²

T counts (layer, real token) rows: layers are pooled before the product, not averaged one by one, as
transformers' load_balancing_loss_func does. Both compute in fp32. `moe_aux_loss` weights them by the
config's router_aux_loss_coef and router_z_loss_coef.

It imports torch and the models' config only; it must never import another relayrl layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from relayrl.models.config import MoEConfig


def _rows(router_logits: Sequence[torch.Tensor], attention_mask: torch.Tensor | None):
    """Per layer: logits [N, E] fp32, and the rows' weights [N] (1 on real tokens) or None."""
    if not router_logits:
        raise ValueError("no router logits: was the forward run with a recording Routing on an MoE model?")
    flat = [lg.reshape(-1, lg.shape[-1]).float() for lg in router_logits]
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(flat[0].device, torch.float32)
    if mask is not None and mask.numel() != flat[0].shape[0]:
        raise ValueError(f"attention_mask has {mask.numel()} tokens, the router logits {flat[0].shape[0]}")
    return flat, mask


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    selected: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """E Σ_e f_e P_e over the layers' logits [..., E] (module docstring); attention_mask [...] drops padding.

    selected: the expert ids [..., k] each layer used (Routing.selections() of a replayed forward), for f;
    default the logits' top-k (transformers' choice, the same when nothing was replayed)."""
    flat, mask = _rows(router_logits, attention_mask)
    E = flat[0].shape[-1]
    counts = torch.zeros(E, dtype=torch.float32, device=flat[0].device)
    prob_sum = torch.zeros(E, dtype=torch.float32, device=flat[0].device)
    rows = 0.0
    for j, lg in enumerate(flat):
        probs = torch.softmax(lg, dim=-1)
        idx = torch.topk(probs, top_k, dim=-1).indices if selected is None else selected[j].reshape(-1, top_k)
        hits = torch.zeros_like(probs).scatter_(1, idx.long(), 1.0)  # [N, E]: 1 where a slot chose e
        if mask is not None:
            hits, probs = hits * mask[:, None], probs * mask[:, None]
        counts = counts + hits.sum(0)
        prob_sum = prob_sum + probs.sum(0)
        rows = rows + (lg.shape[0] if mask is None else mask.sum())
    return E * torch.sum((counts / rows) * (prob_sum / rows))


def router_z_loss(router_logits: Sequence[torch.Tensor], attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over (layer, real token) of logsumexp(logits)²: keeps the router's logits small (ST-MoE)."""
    flat, mask = _rows(router_logits, attention_mask)
    total, rows = 0.0, 0.0
    for lg in flat:
        z2 = torch.logsumexp(lg, dim=-1).square()
        total = total + (z2.sum() if mask is None else (z2 * mask).sum())
        rows = rows + (lg.shape[0] if mask is None else mask.sum())
    return total / rows


def moe_aux_loss(
    router_logits: Sequence[torch.Tensor],
    cfg: MoEConfig,
    attention_mask: torch.Tensor | None = None,
    selected: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """router_aux_loss_coef · load_balancing_loss + router_z_loss_coef · router_z_loss (a term skipped at coef 0)."""
    _rows(router_logits, attention_mask)  # the same checks whichever terms are on
    if selected is not None and len(selected) != len(router_logits):
        raise ValueError(f"{len(selected)} layers of selections for {len(router_logits)} of router logits "
                         "(pass Routing.selections(), one [B, q, k] per MoE layer)")
    loss = torch.zeros((), dtype=torch.float32, device=router_logits[0].device)
    if cfg.router_aux_loss_coef:
        loss = loss + cfg.router_aux_loss_coef * load_balancing_loss(
            router_logits, cfg.num_experts_per_tok, attention_mask, selected)
    if cfg.router_z_loss_coef:
        loss = loss + cfg.router_z_loss_coef * router_z_loss(router_logits, attention_mask)
    return loss


def expert_load(selected: torch.Tensor, num_experts: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Routed slots per expert [n_moe, E] from the selections [B, q, n_moe, k] (real tokens only):
    load.max(-1) / load.mean(-1) is each layer's moe/load_max_over_mean (1 when balanced)."""
    B, q, L, k = selected.shape
    idx = selected.permute(2, 0, 1, 3).reshape(L, B * q * k).long()
    w = torch.ones(L, B * q * k, device=selected.device)
    if attention_mask is not None:
        w = w * attention_mask.reshape(1, B * q, 1).expand(L, B * q, k).reshape(L, -1).to(w)
    return torch.zeros(L, num_experts, device=selected.device).scatter_add_(1, idx, w)


def load_max_over_mean(load: torch.Tensor) -> torch.Tensor | None:
    """Each MoE layer's busiest expert over the mean [n_moe] from a load [n_moe, E] (1 when balanced); None before
    any token was routed. The trainer's moe/load_max_over_mean and the engine's expert-load figure."""
    mean = load.float().mean(-1)
    if not bool((mean > 0).any()):
        return None
    return load.amax(-1).float() / mean.clamp(min=1e-9)
