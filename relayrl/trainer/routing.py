"""This module is the trainer's side of an MoE model's routing: what a forward replays (routing replay, R3), what the
update reports about it, and the routers' auxiliary losses.

    batch.routing [B, T, n_moe, k]   the engine's record (relayrl.engine.routing), rows as the batch's
        │
        ├─ algo.routing_replay ──> Routing(replay=...) in the old-logprob, reference and update forwards
        │                          (relayrl.trainer.logprobs lays it out packed or padded, as the rows go)
        ▼
    update forward's record: logits [B, T, E], selected [B, T, k] per MoE layer (rows' layout)
        own top-k of the logits  vs  the engine's record  ──> moe/routing_mismatch
            share of (response token, MoE layer) choices whose k-expert SET differs; with replay it is what the
            replay overrode, without it what the trainer computed differently from the sampler
        selected (what ran) over real tokens ──> expert load [n_moe, E] ──> moe/load_max_over_mean (max over
            layers of max / mean slots per expert; 1 = balanced), moe/load_max_over_mean/layer_<i> per MoE layer
        logits over real tokens ──> load balancing (f from `selected`), router z-loss (relayrl.models.router_losses)

The auxiliary losses of a micro-batch are computed on its own real tokens and weighted by its share of the
mini-batch's real tokens (global over data-parallel ranks): the z-loss, a mean over tokens, is then exactly the
mini-batch's; load balancing (a product of two means) is the token-weighted mean of the micro-batches' values,
as Megatron-LM takes it per micro-batch, and exactly the mini-batch's with one micro-batch on one rank (so it, and
its figure moe/aux_loss, depend on how the rows are cut; moe/z_loss and the z-loss's gradient do not).

moe/routing_mismatch is measured in the update's forwards: with one optimiser step per batch (old_logp from the
update) those run at the weights that sampled; with several mini-batches the later ones also count the routing the
earlier steps moved.

It imports torch and relayrl.models only; like all of the trainer, it must never import the engine, sync, the
controller or the CLI.
"""

from __future__ import annotations

import torch
from torch import nn

from relayrl.models.config import MoEShape
from relayrl.models.moe import Routing
from relayrl.models.router_losses import expert_load, load_balancing_loss, load_max_over_mean, router_z_loss


def moe_shape(model: nn.Module) -> MoEShape | None:
    """The model's MoE shape, or None for a dense model."""
    cfg = getattr(model, "config", None)
    return cfg if isinstance(cfg, MoEShape) else None


def replay_routing(record: torch.Tensor | None, replay: bool, keep_record: bool = False) -> Routing | None:
    """A forward's Routing: the engine's record replayed when `replay` (and there is one); keep_record also records
    (the update's metrics and losses). None when there is nothing to replay or record."""
    ids = record.long() if replay and record is not None else None
    if ids is None and not keep_record:
        return None
    return Routing(replay=ids, record=keep_record)


@torch.no_grad()
def routing_mismatch(routing: Routing, record: torch.Tensor, response_mask: torch.Tensor, top_k: int) -> float:
    """Share of the (response token, MoE layer) pairs with a full record whose router's own top-k set differs from
    the engine's record [B, T, n_moe, k]. routing: a forward's record (logits in the rows' layout)."""
    own = torch.stack([torch.topk(torch.softmax(lg.float(), -1), top_k, dim=-1).indices
                       for lg in routing.router_logits()], dim=2)  # [B, T, n_moe, k]
    rec = record.to(own.device).long()
    valid = (rec >= 0).all(-1) & (response_mask.to(own.device) > 0)[..., None]
    differ = (own.sort(-1).values != rec.sort(-1).values).any(-1) & valid
    return float(differ.sum()) / max(float(valid.sum()), 1.0)


def router_losses(routing: Routing, attention_mask: torch.Tensor, top_k: int, aux_coef: float, z_coef: float,
                  share: float) -> tuple[torch.Tensor, dict[str, float]]:
    """(aux_coef · load balancing + z_coef · z-loss, both on this micro-batch's real tokens, times `share`: its part
    of the mini-batch's real tokens) and the two values unweighted (moe/aux_loss, moe/z_loss). A term whose
    coefficient is 0 is computed without a graph, for its metric."""
    logits, selected = routing.router_logits(), routing.selections()
    with torch.set_grad_enabled(aux_coef > 0 and torch.is_grad_enabled()):
        lb = load_balancing_loss(logits, top_k, attention_mask, selected)
    with torch.set_grad_enabled(z_coef > 0 and torch.is_grad_enabled()):
        z = router_z_loss(logits, attention_mask)
    loss = torch.zeros((), dtype=torch.float32, device=lb.device)
    if aux_coef > 0:
        loss = loss + aux_coef * share * lb
    if z_coef > 0:
        loss = loss + z_coef * share * z
    return loss, {"moe/aux_loss": float(lb.detach()), "moe/z_loss": float(z.detach())}


@torch.no_grad()
def routed_load(routing: Routing, attention_mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed slots per expert [n_moe, E] over the forward's real tokens (what the experts computed)."""
    return expert_load(routing.selected_experts(), num_experts, attention_mask)


def load_metrics(load: torch.Tensor, moe_layers: tuple[int, ...]) -> dict[str, float]:
    """moe/load_max_over_mean (max over MoE layers) and per layer moe/load_max_over_mean/layer_<i> (the model's
    layer index) from the summed load [n_moe, E]; nothing before any token was routed."""
    ratio = load_max_over_mean(load)
    if ratio is None:
        return {}
    out = {f"moe/load_max_over_mean/layer_{i}": float(r) for i, r in zip(moe_layers, ratio, strict=True)}
    out["moe/load_max_over_mean"] = float(ratio.max())
    return out
