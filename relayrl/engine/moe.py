"""This module is the engine's sparse mixture-of-experts block (Qwen2-MoE, Qwen3-MoE, Mixtral): its experts stacked
per layer and placed over the engine's tensor-parallel ranks by TP or by EP, and the experts it chose for each token
(what routing replay replays in the trainer).

Per MoE layer, for the N new tokens x [N, h] of a batch (the same on every TP rank):

    probs = softmax(gate(x) in fp32) [N, E]     idx = top-k(probs) [N, k]
    w     = probs[idx]  (/ Σ_k w if norm_topk_prob; Qwen: cast to the model dtype, Mixtral: kept fp32)
    partial_r = Σ_{(n, k) computed on rank r} w[n, k] · down(silu(gate(x[n])) * up(x[n]))   (rank r's slice)
                + sigmoid(shared_expert_gate(x)) · shared_expert_r(x)                      (Qwen2-MoE)
    y     = all-reduce over ranks of partial_r    (one all-reduce per block, the shared expert's included)

which is relayrl.models.moe.SparseMoeBlock's arithmetic; the router is replicated, so every rank picks the same
experts and the routing each rank records is the same.

Expert placement (LLMEngine(expert_placement=...)), over tp ranks, E experts of width I:

    "tp"  every rank holds every expert: rows [r I/tp, (r+1) I/tp) of its gate and up, those columns of its down
          (expert tensor parallelism, Megatron's ETP). Every routed pair is computed on every rank, on 1/tp of I.
          Needs tp | I.
    "ep"  rank r holds experts [r E/tp, (r+1) E/tp) whole (expert parallelism). A rank computes only the pairs
          routed to its experts; the all-reduce is the combine. The engine's TP replicates the tokens on every
          rank, so no dispatch all-to-all is needed. Needs tp | E.

The shared expert and the MLPs of dense layers (mlp_only_layers, decoder_sparse_step) are TP-sharded like the dense
model's MLP under both placements.

Parameters (transformers 5's in-memory names; this rank's experts only, in expert order):

    experts.gate_up_proj  [E_local, 2 I_local, h]   expert e: gate rows [0, I_local), up rows [I_local, 2 I_local)
    experts.down_proj     [E_local, h, I_local]

loaded from the published per-expert names (experts.{j}.gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2)
by `weight_loader(param, tensor, (part, j))` with j the global expert (a rank skips the experts it does not hold).
The weight sync writes each as the 2-D view [E_local * rows, cols] of the same storage (ModelRunner.params): the
boxes of relayrl.sync.layout are 2-D.

Dispatch: the (token, slot) pairs this rank computes are sorted by expert; each expert with tokens runs one matmul
over its contiguous chunk (one host sync per layer for the counts), experts without tokens are skipped.

It imports torch, the engine's own modules and relayrl.models only; like the whole engine, it must never import the
trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from relayrl.engine.linear import ColumnParallelLinear, RowParallelLinear
from relayrl.engine.parallel_state import TPInfo
from relayrl.errors import TensorParallelError
from relayrl.models.config import ModelConfig, MoEShape
from relayrl.models.linear import linear
from relayrl.models.moe import EXPERT_PLACEMENTS, expert_split_problem, moe_block_name
from relayrl.models.pointwise import swiglu

PLACEMENTS = EXPERT_PLACEMENTS

# a published expert tensor: (layer prefix, block, expert, projection)
EXPERT_NAME = re.compile(r"^(layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def expert_names(model_type: str) -> tuple[str, str, str]:
    """The (gate, up, down) projection names of one expert in the family's checkpoints."""
    return ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")


def dense_intermediate(cfg: ModelConfig) -> int | None:
    """The dense MLP width TP must divide: None when every layer is an MoE layer (the config's
    intermediate_size then sizes nothing)."""
    if isinstance(cfg, MoEShape) and cfg.every_layer_moe:
        return None
    return cfg.intermediate_size


def check_expert_placement(cfg: ModelConfig, tp: int, placement: str) -> None:
    """Refuse a placement the model's experts cannot be split by (a TensorParallelError naming the size)."""
    if placement not in PLACEMENTS:
        raise TensorParallelError(f"expert_placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if (what := expert_split_problem(cfg, tp, placement)) is not None:
        other = {"tp": "ep", "ep": "tp"}[placement]
        raise TensorParallelError(f"tensor_parallel_size {tp} does not divide {what}; choose a divisor"
                                  + ("" if what.startswith("shared") else f", or expert_placement '{other}'"))


def expert_shard(num_experts: int, width: int, tp: TPInfo, placement: str) -> tuple[range, range]:
    """(experts held, rows of each expert's width held) by this rank."""
    if placement == "ep":
        per = num_experts // tp.size
        return range(tp.rank * per, (tp.rank + 1) * per), range(width)
    per = width // tp.size
    return range(num_experts), range(tp.rank * per, (tp.rank + 1) * per)


def moe_logical_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of one MoE layer's router, experts and shared expert."""
    assert isinstance(cfg, MoEShape)
    h, inter, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    p = f"model.layers.{layer}.{moe_block_name(cfg)}."
    gate, up, down = expert_names(cfg.model_type)
    out = {p + "gate.weight": (E, h)}
    for j in range(E):
        out.update({p + f"experts.{j}.{gate}.weight": (inter, h), p + f"experts.{j}.{up}.weight": (inter, h),
                    p + f"experts.{j}.{down}.weight": (h, inter)})
    s = cfg.shared_expert_intermediate_size
    if s:
        out.update({p + "shared_expert.gate_proj.weight": (s, h), p + "shared_expert.up_proj.weight": (s, h),
                    p + "shared_expert.down_proj.weight": (h, s), p + "shared_expert_gate.weight": (1, h)})
    return out


class StackedExperts(nn.Module):
    """This rank's experts of one layer, stacked (module docstring); forward gives this rank's partial sum."""

    def __init__(self, cfg: MoEShape, tp: TPInfo, placement: str):
        super().__init__()
        self.experts, self.rows = expert_shard(cfg.num_experts, cfg.moe_intermediate_size, tp, placement)
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.num_experts
        n, w, h = len(self.experts), len(self.rows), cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * w, h))
        self.down_proj = nn.Parameter(torch.empty(n, h, w))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[str, int]) -> None:
        part, j = shard
        if j not in self.experts:
            return
        e, w, r = j - self.experts.start, len(self.rows), self.rows
        if part == "down":
            param.data[e].copy_(loaded[:, r.start:r.stop])
        else:
            at = 0 if part == "gate" else w
            param.data[e, at:at + w].copy_(loaded[r.start:r.stop])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Σ over the pairs on this rank of weights[n, k] · expert_{idx[n, k]}(x[n]) on this rank's slice, [N, h]."""
        local = idx.reshape(-1) - self.experts.start
        pairs = torch.arange(local.numel(), device=x.device)
        if len(self.experts) < self.num_experts:  # EP: only the pairs routed to this rank's experts
            pairs = pairs[(local >= 0) & (local < len(self.experts))]
        order = pairs[torch.argsort(local[pairs], stable=True)]
        counts = torch.bincount(local[order], minlength=len(self.experts)).tolist()  # one host sync per layer
        out = torch.zeros_like(x)
        for e, (pair, n) in enumerate(zip(order.split(counts), counts, strict=True)):
            if n == 0:
                continue
            tok = pair // self.top_k
            gate, up = linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = linear(swiglu(gate, up), self.down_proj[e]) * weights.reshape(-1)[pair, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class EngineMoE(nn.Module):
    """One MoE layer's router (replicated), stacked experts and (Qwen2-MoE) gated shared expert."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo, placement: str):
        super().__init__()
        assert isinstance(cfg, MoEShape)
        self.tp, self.num_experts, self.top_k = tp, cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weights_in_model_dtype = cfg.model_type != "mixtral"
        h = cfg.hidden_size
        self.gate = nn.Linear(h, cfg.num_experts, bias=False)
        self.experts = StackedExperts(cfg, tp, placement)
        s = cfg.shared_expert_intermediate_size
        if s:
            self.shared_expert = nn.Module()
            self.shared_expert.gate_up_proj = ColumnParallelLinear(h, s, ("gate", "up"), tp, bias=False)
            self.shared_expert.down_proj = RowParallelLinear(s, h, tp, bias=False, reduce=False)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k], expert ids [N, k]): relayrl.models.moe.SparseMoeBlock.route without a replay."""
        logits = self.gate(x)
        weights, idx = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, idx

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, h] -> (y [N, h], the experts chosen [N, k])."""
        weights, idx = self.route(x)
        out = self.experts(x, weights, idx)
        if self.shared_expert is not None:
            gate, up = self.shared_expert.gate_up_proj(x).chunk(2, dim=-1)
            shared = self.shared_expert.down_proj(swiglu(gate, up))
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return self.tp.all_reduce(out), idx


def engine_expert_name(name: str) -> tuple[str, tuple[str, int]] | None:
    """'layers.0.mlp.experts.3.up_proj.weight' -> ('layers.0.mlp.experts.gate_up_proj', ('up', 3)); None for
    any other name."""
    m = EXPERT_NAME.match(name)
    if m is None:
        return None
    part = PART[m.group(3)]
    return f"{m.group(1)}.{'down_proj' if part == 'down' else 'gate_up_proj'}", (part, int(m.group(2)))
