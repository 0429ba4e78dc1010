"""This module applies tensor parallelism to relayrl.models.CausalLM from a plan written as data.

The plan maps module-name patterns (fnmatch, on Hugging Face names) to a style name; styles become
DTensor ParallelStyles, applied with torch.distributed.tensor.parallel.parallelize_module:

    style            weight held by TP rank r            activations
    colwise          rows r*n/tp ... of W [out, in]      x replicated → y sharded on the last dim
    rowwise          columns r*n/tp ... of W [out, in]   x sharded on the last dim → y all-reduced
    vocab_embedding  rows (token ids) of E [V, h]        ids replicated → h all-reduced (masked lookup)
    vocab_output     rows of lm_head [V, h]              h replicated → logits [B, T, V/tp] (local),
                                                         or gathered to [B, T, V] with gather_logits
    head_norm        replicated per-head norm weight     q / k sharded on the head dim (dim 2): each rank
                                                         normalises its heads; the weight's gradient is
                                                         summed over ranks (qk-norm, Qwen3)

Sequence parallel (sequence_parallel=True, SP_PLAN on top of TP_PLAN): between the TP regions the
residual stream is a DTensor sharded on the sequence (dim 1), so norms and residual adds run on T/tp
tokens per rank and activations there take 1/tp of the memory:

    embed ──reduce-scatter──> h [B, T/tp]   (seq_norm: input_layernorm, post_attention_layernorm, norm)
    self_attn / mlp input: all-gather T ─> colwise ... rowwise ──reduce-scatter──> [B, T/tp] + residual
    lm_head input: all-gather T

Attention: q_proj / k_proj / v_proj colwise give rank r heads [r*H/tp, (r+1)*H/tp) of Q and
[r*K/tp, (r+1)*K/tp) of K/V — the same GQA grouping as the full model (Q head i uses KV head
i // (H/K), and H/tp is a multiple of H/K), so attention runs locally; o_proj rowwise sums the heads'
contributions. The model reads its head counts from attributes, so apply_tensor_parallel sets the
per-rank counts on each Attention module; the model code itself stays unaware of parallelism.

LoRA (a linear with `lora_A` [r, in] and `lora_B` [out, r] beside its weight, relayrl.models.lora): the
low-rank path follows the base linear's sharding, so y = x W^T + s x A^T B^T splits like x W^T alone:

    style     weight         lora_A [r, in]        lora_B [out, r]       why
    colwise   Shard(0) rows  Replicate             Shard(0) rows         x A^T is full; B's rows give y's
    rowwise   Shard(1) cols  Shard(1) cols         Replicate             x_r A_r^T sums over ranks (partial)
                                                                         like x_r W_r^T, then one reduction

The forward runs on DTensors, so the partial sums are reduced by the same output redistribution as the
base linear's, and a replicated adapter's gradient is summed over the TP ranks (see LORA_SHARD_DIM).

It imports torch and relayrl.errors only: the plan names modules by their Hugging Face names, so it
never imports relayrl.models, and it must never import another relayrl layer (models, single_controller,
the trainer, the engine, ...): they import it.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from relayrl.errors import ConfigError

# Module name pattern → style. Order does not matter: every module matches at most one pattern.
TP_PLAN: dict[str, str] = {
    "model.embed_tokens": "vocab_embedding",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.q_norm": "head_norm",
    "model.layers.*.self_attn.k_norm": "head_norm",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "vocab_output",
}

# Overrides of TP_PLAN for sequence parallelism (see the module docstring).
SP_PLAN: dict[str, str] = {
    "model.embed_tokens": "vocab_embedding_sp",
    "model.layers.*.input_layernorm": "seq_norm",
    "model.layers.*.self_attn": "attn_input_sp",
    "model.layers.*.self_attn.o_proj": "rowwise_sp",
    "model.layers.*.post_attention_layernorm": "seq_norm",
    "model.layers.*.mlp": "mlp_input_sp",
    "model.layers.*.mlp.down_proj": "rowwise_sp",
    "model.norm": "seq_norm",
    "lm_head": "vocab_output_sp",
}

# The weight dim each style shards (None: replicated or no weight) — what a reshard planner needs.
WEIGHT_SHARD_DIM: dict[str, int | None] = {
    "colwise": 0, "rowwise": 1, "vocab_embedding": 0, "vocab_output": 0, "head_norm": None,
    "vocab_embedding_sp": 0, "rowwise_sp": 1, "vocab_output_sp": 0, "seq_norm": None,
    "attn_input_sp": None, "mlp_input_sp": None,
}


# The dim each style shards a LoRA adapter on (None: replicated): a colwise linear's output rows live in
# lora_B, a rowwise linear's input columns in lora_A.
LORA_SHARD_DIM: dict[str, dict[str, int | None]] = {
    "colwise": {"lora_A": None, "lora_B": 0},
    "rowwise": {"lora_A": 1, "lora_B": None},
    "rowwise_sp": {"lora_A": 1, "lora_B": None},
}


class _LinearPartition:
    """Shard a linear's parameters by name: weight / bias as the style does, and the LoRA adapters (when
    the linear has them) by LORA_SHARD_DIM. Mixed into torch's Colwise / RowwiseParallel."""

    shard_dims: dict[str, int | None]

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            dim = self.shard_dims[pname]
            placement = Replicate() if dim is None else Shard(dim)
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))


class _Colwise(_LinearPartition, ColwiseParallel):
    shard_dims = {"weight": 0, "bias": 0, **LORA_SHARD_DIM["colwise"]}


class _Rowwise(_LinearPartition, RowwiseParallel):
    shard_dims = {"weight": 1, "bias": None, **LORA_SHARD_DIM["rowwise"]}


def tp_plan(sequence_parallel: bool = False) -> dict[str, str]:
    """The default plan for CausalLM, with or without sequence parallelism."""
    return {**TP_PLAN, **SP_PLAN} if sequence_parallel else dict(TP_PLAN)


def _style(name: str, gather_logits: bool) -> ParallelStyle:
    if name == "colwise":
        return _Colwise()
    if name == "rowwise":
        return _Rowwise()
    if name == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if name == "vocab_output":
        return ColwiseParallel(output_layouts=Replicate() if gather_logits else Shard(-1))
    if name == "head_norm":
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    seq = Shard(1)
    if name == "vocab_embedding_sp":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False)
    if name == "seq_norm":
        return SequenceParallel()
    if name == "attn_input_sp":  # forward(x, cos, sin, mask, kv_cache): only x is sequence-sharded
        return PrepareModuleInput(input_layouts=(seq, None, None, None, None),
                                  desired_input_layouts=(Replicate(), None, None, None, None))
    if name == "mlp_input_sp":
        return PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    if name == "rowwise_sp":
        return _Rowwise(output_layouts=seq, use_local_output=False)
    if name == "vocab_output_sp":
        return ColwiseParallel(input_layouts=seq, output_layouts=Replicate() if gather_logits else Shard(-1))
    raise ConfigError(f"unknown tensor-parallel style {name!r} (known: {', '.join(WEIGHT_SHARD_DIM)})")


def check_tp_divisibility(cfg, tp: int) -> None:
    """Every sharded size must split evenly over tp ranks; name the first one that does not."""
    sizes = {
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
    }
    for name, size in sizes.items():
        if size % tp:
            raise ConfigError(f"tensor parallel degree {tp} does not divide {name} = {size}; "
                              f"choose tp among the divisors of {name}")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str] | None = None,
                          *, gather_logits: bool = False, sequence_parallel: bool = False) -> nn.Module:
    """Shard `model` (a CausalLM) over tp_mesh in place, following `plan` (default tp_plan(...)).

    After this, model(...) returns logits sharded on the vocab, [B, T, V/tp] on each rank (use
    relayrl.parallel.vocab_parallel for logprobs), or the full [B, T, V] with gather_logits=True.
    With sequence parallelism a sequence length not divisible by tp works too (DTensor pads the shards).
    """
    plan = tp_plan(sequence_parallel) if plan is None else plan
    tp = tp_mesh.size()
    cfg = model.config
    check_tp_divisibility(cfg, tp)
    # a model without a language-model head (a critic's or reward model's score head) has nothing to tie, nor has
    # a pipeline stage holding one of the two (relayrl.parallel.pipeline_split: the last holds its own copy)
    tied = cfg.tie_word_embeddings and hasattr(model, "lm_head") and hasattr(model.model, "embed_tokens")
    for name, module in model.named_modules():
        styles = [s for pattern, s in plan.items() if fnmatch(name, pattern)]
        if len(styles) > 1:
            raise ConfigError(f"module {name!r} matches several tensor-parallel styles: {styles}")
        if styles:
            parallelize_module(module, tp_mesh, _style(styles[0], gather_logits))
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.n_heads = cfg.num_attention_heads // tp
        attn.n_kv = cfg.num_key_value_heads // tp
    if tied:
        # Each style made its own DTensor from the once-shared parameter; share it again. Both
        # shard the [V, h] weight on dim 0, so one DTensor serves the lookup and the projection.
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        if embed.placements != head.placements:
            raise ConfigError("tied embeddings need the same TP layout for embed_tokens and lm_head "
                              f"(got {embed.placements} and {head.placements})")
        model.lm_head.weight = embed
    return model
