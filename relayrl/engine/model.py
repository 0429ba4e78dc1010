"""This module is the engine's inference model, with fused projections, tensor-parallel shards and paged
attention.

    per layer:  x ─norm─> qkv_proj (column-parallel, fused) ─> q | k | v ─rope─> paged attention
                  ─> o_proj (row-parallel, all-reduce) ─+─ norm ─> gate_up_proj (column-parallel,
                  fused) ─> silu(gate) * up ─> down_proj (row-parallel, all-reduce) ─+

Every parallel layer knows how to load its parameters from the trainer-side (Hugging Face) names
through its `weight_loader(param, tensor, shard)`: q, k and v each land in their own rows of this rank's
`qkv_proj` (its Q heads, then the KV heads those Q heads use), gate and up in their halves of
`gate_up_proj`. Fused tensors are only ever filled component by component — never by slicing an
assembled fused matrix, whose row blocks would not line up with q/k/v boundaries under TP.
Embedding, lm_head and norms are replicated on every rank. The linears live in relayrl.engine.linear.

MoE models (Qwen2-MoE, Qwen3-MoE, Mixtral): an MoE layer's MLP is relayrl.engine.moe's block, under the family's
name (`mlp`, Mixtral's `block_sparse_moe`): a replicated router, the experts stacked and placed by TP or EP
(`expert_placement`), the shared expert TP-sharded; each expert's published tensors load into their slots of the
stacked ones (engine_name). The forward appends each MoE layer's chosen experts to `routing` when given.

With LoRA (relayrl.engine.lora) a fused or row-parallel projection may carry `lora`, its adapters: the
forward adds their low-rank term when they are kept apart (`lora.separate`), and nothing otherwise.

What may be loaded is checked against the model config first (`check_weights`): every tensor must
have exactly the logical shape `logical_shapes(config)` gives for its Hugging Face name, an unknown
name or a missing tensor is refused, and nothing is ever sliced or broadcast to fit. The loaders below
then slice only the rows and columns of this rank's shard out of a tensor already known to be whole.

It imports torch, the engine's own modules and relayrl.models only; like the whole engine, it must never
import the trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

import torch
from torch import nn

from relayrl.engine.attention import PagedBatch, paged_attention
from relayrl.engine.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, _copy_weight
from relayrl.engine.moe import EngineMoE, engine_expert_name, moe_logical_shapes
from relayrl.engine.parallel_state import TPInfo
from relayrl.errors import WeightShapeError
from relayrl.models.config import ModelConfig, MoEShape
from relayrl.models.fusion import FUSED_INTO
from relayrl.models.linear import Linear
from relayrl.models.moe import moe_block_name
from relayrl.models.pointwise import swiglu
from relayrl.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from relayrl.models.transformer import RMSNorm

# trainer (HF) module name -> (engine module name, shard id)
FUSED = {part: (fused, part.removesuffix("_proj")) for part, (fused, _) in FUSED_INTO.items()}


# buffers some checkpoints carry (older Llama ones) that are derived from the config: recomputed, never loaded
DERIVED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def logical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor the config implies (lm_head.weight listed even when
    tied: a checkpoint or a model's state_dict may carry it, always of the embedding's shape)."""
    H, V, F, hd = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim  # F: the MLP's width
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(cfg.num_hidden_layers):
        layer, attn, mlp = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[layer + "input_layernorm.weight"] = out[layer + "post_attention_layernorm.weight"] = (H,)
        out.update({attn + "q_proj.weight": (q, H), attn + "k_proj.weight": (kv, H), attn + "v_proj.weight": (kv, H),
                    attn + "o_proj.weight": (H, q)})
        if cfg.qkv_bias:
            out.update({attn + "q_proj.bias": (q,), attn + "k_proj.bias": (kv,), attn + "v_proj.bias": (kv,)})
        if cfg.o_bias:
            out[attn + "o_proj.bias"] = (H,)
        if cfg.qk_norm:
            out[attn + "q_norm.weight"] = out[attn + "k_norm.weight"] = (hd,)
        if isinstance(cfg, MoEShape) and cfg.is_moe_layer(i):  # router and experts in the MLP's place
            out.update(moe_logical_shapes(cfg, i))
            continue
        out.update({mlp + "gate_proj.weight": (F, H), mlp + "up_proj.weight": (F, H), mlp + "down_proj.weight": (H, F)})
        if cfg.mlp_bias:
            out.update({mlp + "gate_proj.bias": (F,), mlp + "up_proj.bias": (F,), mlp + "down_proj.bias": (H,)})
    return out


def _check_one(shapes: dict[str, tuple[int, ...]], name: str, tensor: torch.Tensor) -> None:
    want = shapes.get(name)
    if want is None:
        raise WeightShapeError(f"tensor '{name}' {tuple(tensor.shape)} is not part of the model the config describes "
                               f"(no such name); check that the weights belong to this config.json")
    if tuple(tensor.shape) != want:
        raise WeightShapeError(f"tensor '{name}' has shape {tuple(tensor.shape)}, the model config implies {want}; "
                               f"check that the weights belong to this config.json")
    if not tensor.is_floating_point():
        raise WeightShapeError(f"tensor '{name}' has dtype {tensor.dtype}; weights must be floating point")


def check_weights(cfg: ModelConfig, weights) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs to load, each of exactly its logical shape, none missing, none twice;
    derived rope buffers are dropped. Raises WeightShapeError naming the first offending tensor."""
    shapes = logical_shapes(cfg)
    kept, seen = [], set()
    for name, tensor in weights:
        if name.endswith(DERIVED_SUFFIXES):
            continue
        _check_one(shapes, name, tensor)
        if name in seen:
            raise WeightShapeError(f"tensor '{name}' is given twice")
        seen.add(name)
        kept.append((name, tensor))
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(shapes) - seen - optional)
    if missing:
        raise WeightShapeError(f"the weights lack tensor '{missing[0]}' ({len(missing)} missing in all) that the "
                               f"model config implies; check that the weights belong to this config.json")
    return kept


class EngineAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPInfo):
        super().__init__()
        self.layer, self.hd, self.window = layer, cfg.head_dim, cfg.sliding_window
        self.qkv_proj = QKVParallelLinear(cfg, tp)
        self.nq, self.nkv = len(self.qkv_proj.q_heads), len(self.qkv_proj.kv_heads)
        q = self.qkv_proj.q_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.hd, cfg.hidden_size, tp, bias=cfg.o_bias,
                                        col_ranges=range(q.start * self.hd, q.stop * self.hd))
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, batch: PagedBatch, kv_cache):
        N = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.nq * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q, k, v = q.view(N, self.nq, self.hd), k.view(N, self.nkv, self.hd), v.view(N, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # rope over [1, heads, N, hd] with cos/sin [1, N, hd]
        q = apply_rope(q.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
        k = apply_rope(k.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
        out = paged_attention(q, k, v, kv_cache[self.layer], batch)
        return self.o_proj(out.reshape(N, self.nq * self.hd))


class EngineMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, ("gate", "up"), tp,
                                                 bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(swiglu(gate, up))


class EngineLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPInfo, expert_placement: str = "tp"):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = EngineAttention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # an MoE layer's block sits where the MLP would, under its family's checkpoint name (relayrl.engine.moe)
        self.moe = isinstance(cfg, MoEShape) and cfg.is_moe_layer(layer)
        self.ffn_name = moe_block_name(cfg) if self.moe else "mlp"
        self.add_module(self.ffn_name, EngineMoE(cfg, tp, expert_placement) if self.moe else EngineMLP(cfg, tp))

    def forward(self, x, cos, sin, batch, kv_cache, routing: list | None = None):
        """routing: a list to append this layer's experts [N, k] to (an MoE layer only), or None."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv_cache)
        h = self.post_attention_layernorm(x)
        if not self.moe:
            return x + self.mlp(h)
        y, idx = getattr(self, self.ffn_name)(h)
        if routing is not None:
            routing.append(idx)
        return x + y


class EngineModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo = TPInfo(), expert_placement: str = "tp"):
        super().__init__()
        self.config, self.tp, self.expert_placement = cfg, tp, expert_placement
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(EngineLayer(cfg, i, tp, expert_placement) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, batch: PagedBatch, kv_cache,
                routing: list | None = None) -> torch.Tensor:
        """input_ids [N] (all new tokens of the batch, flattened) -> logits [B] at each sequence's last token.
        routing (MoE models): a list that gets each MoE layer's experts [N, k], in cfg.moe_layers order."""
        h = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, batch.positions[None], h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, batch, kv_cache, routing)
        h = self.norm(h[batch.last_index])
        return self.lm_head(h)

    # ---- weight loading from trainer-side (Hugging Face) names ----
    def engine_name(self, hf_name: str) -> tuple[str, str | None]:
        """'model.layers.0.self_attn.k_proj.weight' -> ('layers.0.self_attn.qkv_proj.weight', 'k');
        'model.layers.0.mlp.experts.3.up_proj.weight' -> ('layers.0.mlp.experts.gate_up_proj', ('up', 3))."""
        name = hf_name.removeprefix("model.")
        expert = engine_expert_name(name)
        if expert is not None:
            return expert
        for src, (dst, shard) in FUSED.items():
            if f".{src}." in name:
                return name.replace(f".{src}.", f".{dst}."), shard
        return name, None

    @torch.no_grad()
    def load_weights(self, weights) -> set[str]:
        """Load (HF name, full logical tensor) pairs; returns the engine parameter names touched."""
        params = dict(self.named_parameters(remove_duplicate=False))
        shapes = logical_shapes(self.config)
        touched = set()
        for hf_name, tensor in weights:
            if hf_name.endswith(DERIVED_SUFFIXES):
                continue
            _check_one(shapes, hf_name, tensor)  # a shard is sliced only out of a whole tensor
            name, shard = self.engine_name(hf_name)
            if name not in params:
                raise KeyError(f"engine has no parameter for '{hf_name}' (looked for '{name}')")
            p = params[name]
            # the owning module slices its own shard; plain (replicated) parameters copy whole
            owner = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
            loader = getattr(owner, "weight_loader", _copy_weight)
            loader(p, tensor.to(p.dtype), shard)
            touched.add((name, shard))
        return touched

    def expected_loads(self) -> set[tuple[str, str | None]]:
        """Every (engine parameter, shard) a complete sync must write."""
        out = set()
        for name, _ in self.named_parameters(remove_duplicate=False):
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            mod = name.rsplit(".", 2)[-2]
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # every expert, wherever it is placed
                parts = ("gate", "up") if name.endswith("gate_up_proj") else ("down",)
                out |= {(name, (p, j)) for p in parts for j in range(self.config.num_experts)}
            elif mod == "qkv_proj":
                out |= {(name, s) for s in ("q", "k", "v")}
            elif mod == "gate_up_proj":
                out |= {(name, s) for s in ("gate", "up")}
            else:
                out.add((name, None))
        return out
