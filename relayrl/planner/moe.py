"""Mixture-of-experts shapes for the plan, and what expert parallelism (EP) does to a rank's share.

The plan counts an MoE model (relayrl.models.moe) from its config alone, the way the dense decoder is
counted, so that a cluster can be sized before the model runs. Every decoder layer is an MoE layer (Qwen3-MoE,
Qwen2-MoE with decoder_sparse_step 1, Mixtral, whose tensors are named block_sparse_moe.experts.{j}.w1/w3/w2 in
its checkpoints; the plan counts them under the Qwen names): attention as in the dense model, then

    router       mlp.gate.weight [E, h]                         every token: softmax over E, top-k
    experts      mlp.experts.{j}.{gate,up}_proj.weight [I, h], .down_proj.weight [h, I]   (I = moe_intermediate)
    shared       mlp.shared_expert.{gate,up,down}_proj (I_s), mlp.shared_expert_gate.weight [1, h]  (Qwen2-MoE)

Placement (torchtitan's and Megatron's defaults):
    - expert tensor parallel = TP: an expert's gate/up are colwise (I / t rows), down rowwise, as the dense MLP;
      the router and the shared-expert gate are replicated over TP;
    - EP carves the experts out of the data-parallel shard group (dp_shard x cp ranks): the group's ep innermost
      ranks each hold E / ep whole experts, and the n / ep ranks that hold the same experts shard them further
      as FSDP / ZeRO shard everything else ("expert FSDP"). EP needs a sharding dp_mode and ep | dp_shard x cp.

Per token and layer (balanced routing: every rank computes s b k of the group's routed tokens on average;
dropless, no capacity factor; the profiler's moe/load_max_over_mean says how far a run is from it):

    activations    router softmax 4 s b E (fp32) + top-k weights 4 s b k; the dispatched copies e s b k h (the
                   experts' input); per routed copy the SwiGLU 4 e I / t; the combine keeps the experts'
                   outputs e s b k h; a shared expert 4 e s b I_s / t + its gate e s b
    all-to-all     dispatch and combine, forward and backward (4, 6 with full recompute) of e s b k h, of which
                   (ep - 1) / ep leaves the rank
    FLOPs          the active weights: attention + router h E + k experts (3 h I) + the shared expert, per token
                   (relayrl.models.flops on the dense shape whose MLP is k I + I_s wide, plus 6 h E per layer)
    engine         experts sharded by the engine's TP like a dense MLP E I + I_s wide, the router replicated

It imports relayrl.errors and relayrl.models.config (where MoEShape lives) only.
"""

from __future__ import annotations

from relayrl.errors import ConfigError
from relayrl.models.config import ModelShape, MoEShape

DENSE_LAYERS_REFUSED = ("relayrl plan models MoE checkpoints whose every layer is MoE; this config has dense layers "
                        "between them (decoder_sparse_step / mlp_only_layers / first_k_dense_replace)")


def plan_shape(shape: ModelShape) -> ModelShape:
    """What the planner's cached tables take: an MoEShape (of an MoEConfig too), anything else as its ModelShape.
    Dense layers between MoE ones are refused, as in moe_shape_from_hf."""
    if not isinstance(shape, MoEShape):
        return ModelShape.of(shape)
    if not shape.every_layer_moe:
        raise ConfigError(DENSE_LAYERS_REFUSED)
    return MoEShape.of(shape)


def moe_shape_from_hf(d: dict) -> MoEShape:
    """An MoEShape from a Hugging Face config.json of Qwen2-MoE / Qwen3-MoE (num_experts) or Mixtral
    (num_local_experts). Layouts the plan does not model (dense layers between MoE ones) are refused."""
    experts = d.get("num_experts", d.get("num_local_experts"))
    if experts is None:
        raise ConfigError("config.json has no num_experts / num_local_experts: not an MoE model")
    step = d.get("decoder_sparse_step", 1)
    if step != 1 or d.get("mlp_only_layers") or d.get("first_k_dense_replace"):
        raise ConfigError(DENSE_LAYERS_REFUSED)
    heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    # Mixtral's experts are intermediate_size wide; Qwen's MoE layers use moe_intermediate_size
    inter = d.get("moe_intermediate_size", d.get("intermediate_size"))
    return MoEShape(
        vocab_size=d["vocab_size"], hidden_size=hidden, intermediate_size=d.get("intermediate_size", inter),
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads", heads), head_dim=d.get("head_dim") or hidden // heads,
        qkv_bias=bool(d.get("qkv_bias", d.get("model_type") == "qwen2_moe" or d.get("attention_bias", False))),
        o_bias=bool(d.get("attention_bias", False)) and d.get("model_type") != "qwen2_moe",
        qk_norm=d.get("model_type") == "qwen3_moe", tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        num_experts=experts, num_experts_per_tok=d["num_experts_per_tok"], moe_intermediate_size=inter,
        shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0) or 0)


def moe_layer_tensors(shape: MoEShape, layer: int, tp: int, ep: int, e: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, TP-local shape) of one MoE layer's MLP on EP rank e of ep, TP degree tp (module docstring)."""
    h, inter = shape.hidden_size, shape.moe_intermediate_size
    if inter % tp:
        raise ConfigError(f"tp={tp} does not divide moe_intermediate_size={inter}")
    if shape.num_experts % ep:
        raise ConfigError(f"ep={ep} does not divide num_experts={shape.num_experts}")
    p = f"model.layers.{layer}.mlp"
    out = [(f"{p}.gate.weight", (shape.num_experts, h))]
    local = shape.num_experts // ep
    for j in range(e * local, (e + 1) * local):
        out += [(f"{p}.experts.{j}.gate_proj.weight", (inter // tp, h)),
                (f"{p}.experts.{j}.up_proj.weight", (inter // tp, h)),
                (f"{p}.experts.{j}.down_proj.weight", (h, inter // tp))]
    if shape.shared_width:
        si = shape.shared_width
        if si % tp:
            raise ConfigError(f"tp={tp} does not divide shared_expert_intermediate_size={si}")
        out += [(f"{p}.shared_expert.gate_proj.weight", (si // tp, h)),
                (f"{p}.shared_expert.up_proj.weight", (si // tp, h)),
                (f"{p}.shared_expert.down_proj.weight", (h, si // tp)),
                (f"{p}.shared_expert_gate.weight", (1, h))]
    return out


def is_expert_tensor(name: str) -> bool:
    """Held by E / ep ranks' worth of the shard group (expert FSDP), not by the whole group."""
    return ".mlp.experts." in name


def moe_mlp_terms(shape: MoEShape, s: float, b: int, t: int, e: int) -> list[tuple[str, float, str]]:
    """Per-layer, per-micro-batch activation bytes of the MoE MLP on one rank, in place of the dense SwiGLU's."""
    E, k, h, inter = shape.num_experts, shape.num_experts_per_tok, shape.hidden_size, shape.moe_intermediate_size
    out = [("router", 4 * s * b * E + 4 * s * b * k,
            f"fp32 softmax over E={E} experts and the top-{k} weights: 4 s b (E + k)"),
           ("dispatched tokens", e * s * b * k * h, f"each token's {k} routed copies, the experts' input: e s b k h"),
           ("expert swiglu", 4 * e * s * b * k * inter / t,
            f"gate, up, silu(gate), product per routed copy: 4 e s b k I / t, I={inter}"),
           ("expert outputs", e * s * b * k * h, "kept by the combine's weighted sum: e s b k h")]
    if shape.shared_width:
        out.append(("shared expert", 4 * e * s * b * shape.shared_width / t + e * s * b,
                    f"SwiGLU of I_s={shape.shared_width}: 4 e s b I_s / t, and its sigmoid gate e s b"))
    return out


def router_params(shape: ModelShape) -> int:
    """L h E: the routers' matmul weights (0 for a dense model); 2x per token forward, 6x in training."""
    return shape.num_hidden_layers * shape.hidden_size * shape.num_experts if isinstance(shape, MoEShape) else 0


def mlp_widths(shape: ModelShape) -> tuple[int, ...]:
    """The MLP widths a TP degree must divide: the experts' and the shared expert's, or the dense MLP's."""
    if isinstance(shape, MoEShape):
        return (shape.moe_intermediate_size, shape.shared_width)
    return (shape.intermediate_size,)


# Public config.json shapes of MoE models (relayrl plan --preset)
MOE_PRESETS: dict[str, MoEShape] = {
    "qwen3-30b-a3b": MoEShape(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                              num_attention_heads=32, num_key_value_heads=4, head_dim=128, qk_norm=True,
                              num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "mixtral-8x7b": MoEShape(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336),
    "qwen2-57b-a14b": MoEShape(vocab_size=151936, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                               num_attention_heads=28, num_key_value_heads=4, head_dim=128, qkv_bias=True,
                               num_experts=64, num_experts_per_tok=8, moe_intermediate_size=2560,
                               shared_expert_intermediate_size=20480),
}
