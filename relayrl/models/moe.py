"""This module defines the sparse mixture-of-experts block of the Qwen2-MoE, Qwen3-MoE and Mixtral families:
top-k token-choice routing, the family's weight normalisation, a gated shared expert where the family has one,
and the two things routing replay needs (an override of the selected experts, a record of what was chosen).

Per MoE layer, for the N = B q tokens x [N, h]:

    logits = gate(x)                      [N, E]   (model dtype, no bias)
    p      = softmax(logits) in fp32      [N, E]
    idx    = top-k(p)  or the replayed ids [N, k]
    w      = p[idx]; w /= Σ_k w  if norm_topk_prob (Mixtral: always)
    y[n]   = Σ_k w[n, k] · expert_{idx[n, k]}(x[n])  (+ sigmoid(shared_expert_gate(x[n])) · shared_expert(x[n]))

Qwen casts w to the model dtype before the product; Mixtral keeps it fp32 (as transformers does, so bf16
outputs round alike). A replayed routing still takes its weights from this router's probabilities, so the
router keeps its gradient.

Dispatch (`grouped_experts`): the N k (token, slot) pairs are sorted by expert, so each expert runs one matmul
over a contiguous chunk and its outputs are added back at their tokens. Every expert runs, on an empty chunk if
no token chose it, so every parameter has a gradient and DDP / FSDP see the same graph.

The experts' computation is swappable per block from outside with the same signature (`experts_fn`, as
Attention.attention_fn): expert parallelism (relayrl.parallel.expert_parallel) sets one that sends the sorted
pairs to the ranks holding their experts by all-to-all and back; the router, the weights and the shared expert
stay here.

Parameter names are those of the published checkpoints (and of what transformers' save_pretrained writes):

    qwen2_moe, qwen3_moe   mlp.gate.weight [E, h], mlp.experts.{j}.{gate,up,down}_proj.weight,
                           qwen2_moe: mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight [1, h]
    mixtral                block_sparse_moe.gate.weight, block_sparse_moe.experts.{j}.w1 (gate) / w3 (up) / w2 (down)

transformers >= 5 holds the experts stacked in memory (experts.gate_up_proj [E, 2 I, h], experts.down_proj
[E, h, I]); `unstack_experts` turns a state dict in that layout (save_pretrained(save_original_format=False))
into these names.

It imports torch and the models' config only; it must never import another relayrl layer: models hold no
parallelism, and every layer above imports them.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from relayrl.models.config import MoEConfig, MoEShape
from relayrl.models.linear import Linear
from relayrl.models.pointwise import swiglu


class Routing:
    """One forward's routing: what its MoE layers replay, and what they record (CausalLM.forward(routing=...)).

    replay: [B, q, n_moe, k] expert ids, n_moe = len(cfg.moe_layers): each token's experts per MoE layer, used
        instead of the router's top-k (routing replay, R3: the ids the rollout engine recorded). A token whose k ids
        are not all >= 0 (-1: the engine never ran it; padding) routes by its own top-k. None: route.
    record: fill `logits` and `selected`, keyed by the MoE layer's position j in cfg.moe_layers. A recomputed
        layer (activation checkpointing) writes the same values again.

    A plain class, not a dataclass: FSDP2 rebuilds the dataclasses among a module's inputs that hold tensors with
    gradients (to hook them), so after the first MoE layer had recorded its logits every later layer would write
    into a copy of a dataclass record, not into the caller's."""

    def __init__(self, replay: torch.Tensor | None = None, record: bool = True):
        self.replay, self.record = replay, record
        self.logits: dict[int, torch.Tensor] = {}  # j -> [B, q, E] router logits, with grad
        self.selected: dict[int, torch.Tensor] = {}  # j -> [B, q, k] expert ids (int64)

    def router_logits(self) -> list[torch.Tensor]:
        """The recorded router logits [B, q, E], one per MoE layer in order (what the router losses take)."""
        return [self.logits[j] for j in sorted(self.logits)]

    def selections(self) -> list[torch.Tensor]:
        """The recorded expert ids [B, q, k], one per MoE layer in order (load_balancing_loss's `selected`)."""
        return [self.selected[j] for j in sorted(self.selected)]

    def selected_experts(self) -> torch.Tensor:
        """The recorded selections stacked as [B, q, n_moe, k]: the layout `replay` takes."""
        return torch.stack(self.selections(), dim=2)


class SwiGLU(nn.Module):
    """An expert (or the shared expert) of the Qwen MoE families: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class MixtralExpert(nn.Module):
    """Mixtral's expert, the same SwiGLU under its checkpoint's names: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = Linear(hidden, inter, bias=False)
        self.w2 = Linear(inter, hidden, bias=False)
        self.w3 = Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def moe_block_name(cfg: MoEConfig) -> str:
    """The decoder layer's attribute (and checkpoint name) of its MoE block."""
    return "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"


def grouped_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor,
                    idx: torch.Tensor) -> torch.Tensor:
    """Σ_k weights[n, k] · experts[idx[n, k]](x[n]) for x [N, h], weights / idx [N, k]: the pairs grouped by expert
    (module docstring), every expert run once."""
    top_k = idx.shape[1]
    pair_expert = idx.reshape(-1)
    order = torch.argsort(pair_expert, stable=True)
    counts = torch.bincount(pair_expert, minlength=len(experts)).tolist()  # one host sync per layer
    token = order // top_k  # the token of each sorted (token, slot) pair
    out = torch.zeros_like(x)
    for expert, tok, w in zip(experts, token.split(counts), weights.reshape(-1)[order].split(counts), strict=True):
        y = expert(x[tok]) * w[:, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


class SparseMoeBlock(nn.Module):
    """One layer's router, experts and (Qwen2-MoE) gated shared expert; `index` is its position in cfg.moe_layers."""

    # The routed experts' computation, experts_fn(self.experts, x [N, h], weights [N, k], idx [N, k]) -> [N, h],
    # swappable per block from outside: expert parallelism (relayrl.parallel.expert_parallel) sets one that
    # dispatches the pairs to the ranks holding their experts (self.experts then holds this rank's only).
    experts_fn = staticmethod(grouped_experts)

    def __init__(self, cfg: MoEConfig, index: int):
        super().__init__()
        self.index = index
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weights_in_model_dtype = cfg.model_type != "mixtral"
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Linear(h, cfg.num_experts, bias=False)
        expert = MixtralExpert if cfg.model_type == "mixtral" else SwiGLU
        self.experts = nn.ModuleList(expert(h, inter) for _ in range(cfg.num_experts))
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(h, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(h, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: torch.Tensor, replay: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [N, E], weights [N, k], expert ids [N, k]) for tokens x [N, h]; replay [N, k] fixes the ids of
        the tokens whose k ids are all >= 0 (the others route by their own top-k)."""
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        if replay is None:
            weights, idx = torch.topk(probs, self.top_k, dim=-1)
        else:
            idx = replay.long()
            if bool(((idx < -1) | (idx >= self.num_experts)).any()):  # a host sync, only when replaying
                raise ValueError(f"routing replay names an expert outside 0..{self.num_experts - 1} (-1: route)")
            known = (idx >= 0).all(-1, keepdim=True)
            idx = torch.where(known, idx, torch.topk(probs, self.top_k, dim=-1).indices)
            weights = probs.gather(-1, idx)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return logits, weights, idx

    def forward(self, x: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        B, q, h = x.shape
        flat = x.reshape(-1, h)
        replay = None
        if routing is not None and routing.replay is not None:
            r = routing.replay
            if r.dim() != 4 or r.shape[:2] != (B, q) or r.shape[3] != self.top_k or self.index >= r.shape[2]:
                raise ValueError(f"routing replay has shape {tuple(r.shape)}; this forward needs [B={B}, q={q}, "
                                 f"n_moe > {self.index}, k={self.top_k}]")
            replay = r[:, :, self.index].reshape(-1, self.top_k)
        logits, weights, idx = self.route(flat, replay)
        if routing is not None and routing.record:
            routing.logits[self.index] = logits.view(B, q, -1)
            routing.selected[self.index] = idx.view(B, q, -1)
        out = self.experts_fn(self.experts, flat, weights, idx)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(B, q, h)


_STACKED = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def unstack_experts(sd: dict[str, torch.Tensor], cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """`sd` with transformers 5's stacked experts (and Mixtral's in-memory `mlp.` prefix) renamed to checkpoint names:

        mlp.experts.gate_up_proj [E, 2 I, h]  ->  experts.{j}.gate_proj = [j, :I], experts.{j}.up_proj = [j, I:]
        mlp.experts.down_proj    [E, h, I]    ->  experts.{j}.down_proj = [j]
        (mixtral: block_sparse_moe.experts.{j}.w1 / w3 / w2, and mlp.gate.weight -> block_sparse_moe.gate.weight)

    A state dict already in checkpoint names comes back unchanged."""
    mixtral = cfg.model_type == "mixtral"
    block = moe_block_name(cfg)
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        m = _STACKED.match(name)
        if m is None:
            if mixtral and re.match(r"^model\.layers\.\d+\.mlp\.gate\.weight$", name):
                name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            out[name] = t
            continue
        prefix, kind = f"{m.group(1)}.{block}.experts", m.group(2)
        for j in range(t.shape[0]):
            if kind == "gate_up_proj":
                g, u = t[j].chunk(2, dim=0)
                out[f"{prefix}.{j}.{gate}.weight"], out[f"{prefix}.{j}.{up}.weight"] = g, u
            else:
                out[f"{prefix}.{j}.{down}.weight"] = t[j]
    return out


EXPERT_PLACEMENTS = ("tp", "ep")  # how engine ranks split experts: each expert's width, or whole experts


def expert_split_problem(cfg, tp: int, placement: str) -> str | None:
    """What `tp` ranks do not divide when they split the model's experts by `placement` (a placement of
    EXPERT_PLACEMENTS), or None when they can; a dense model always can. The engine and the sync plan each say
    it in their own error: "<tp> does not divide " + this."""
    if not isinstance(cfg, MoEShape):
        return None
    if placement == "tp" and cfg.moe_intermediate_size % tp:
        return f"the experts' width ({cfg.moe_intermediate_size}) for expert_placement 'tp'"
    if placement == "ep" and cfg.num_experts % tp:
        return f"the number of experts ({cfg.num_experts}) for expert_placement 'ep'"
    if cfg.shared_expert_intermediate_size % tp:
        return f"shared_expert_intermediate_size ({cfg.shared_expert_intermediate_size})"
    return None
