"""This module defines a plain decoder-only transformer for the Llama / Mistral / Qwen2 / Qwen3 families, and
with relayrl.models.moe's block in place of the MLP for the Qwen2-MoE / Qwen3-MoE / Mixtral families.

Module and parameter names mirror Hugging Face's (`model.layers.3.self_attn.q_proj.weight`), so a
checkpoint loads by name and the sync layer can speak of logical tensors. No parallelism lives here:
tensor / data parallelism is applied to this module from outside, and context parallelism replaces each
Attention's `attention_fn` (SDPA by default) from outside too.

One forward serves training (full sequences) and generation (a KV cache):

    input_ids [B, q] ──embed──> h ──(attn + mlp) x L──> norm ──lm_head──> logits [B, q, V]

Attention mask: query at cache slot s attends key slot j iff j <= s, key j is a real token
(`attention_mask[b, j] == 1`), and j > s - sliding_window when the model has a window. Every query
also attends to itself, so padding rows never become an all-masked softmax (NaN that would leak
through 0 * NaN into later layers); their outputs are ignored anyway. When every row is full (no padding,
no window, no cache, no packing) no mask is built: attention runs SDPA's causal kernel.

It imports torch and the models' own modules only; it must never import another relayrl layer: models
hold no parallelism, and every layer above imports them.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from relayrl.models.config import ModelConfig, MoEShape
from relayrl.models.linear import Linear
from relayrl.models.moe import Routing, SparseMoeBlock, moe_block_name
from relayrl.models.packed import PackedLayout
from relayrl.models.pointwise import rms_norm, swiglu
from relayrl.models.rope import apply_rope, rope_cos_sin, rope_inv_freq


class KVCacheLike(Protocol):
    """What the model needs from a KV cache: append this step's k/v, get all of them back."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    @property
    def past_len(self) -> int: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def sdpa_attention(q, k, v, mask, enable_gqa: bool) -> torch.Tensor:
    """The attention computation: q [B, H, q, D], k / v [B, KV, kv, D], mask bool [B, 1, q, kv] (True = may
    attend), or None for plain causal attention with q = kv (SDPA's is_causal kernel, which skips the masked
    half) → [B, H, q, D]."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


class Attention(nn.Module):
    # The attention computation, swappable per module from outside with the same signature: context
    # parallelism (relayrl.parallel.context_parallel) sets one that attends over the whole sequence while
    # this rank holds a shard of it (it then ignores `mask`, which the model built for the local shard).
    attention_fn = staticmethod(sdpa_attention)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = Linear(h, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = Linear(h, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(h, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, mask, kv_cache: KVCacheLike | None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)
        if isinstance(mask, PackedLayout):
            out = mask.attend(q, k, v, self.attention_fn, self.n_kv != self.n_heads)
        else:
            out = self.attention_fn(q, k, v, mask, self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # an MoE layer's block sits where the MLP would, under its family's checkpoint name (relayrl.models.moe)
        self.moe = isinstance(cfg, MoEShape) and cfg.is_moe_layer(layer)
        self.ffn_name = moe_block_name(cfg) if self.moe else "mlp"
        if self.moe:
            self.add_module(self.ffn_name, SparseMoeBlock(cfg, cfg.moe_layers.index(layer)))
        else:
            self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, kv_cache, routing: Routing | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache)
        ffn = getattr(self, self.ffn_name)
        h = self.post_attention_layernorm(x)
        return x + (ffn(h, routing) if self.moe else ffn(h))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def build_attention_mask(
    attention_mask: torch.Tensor,
    q_len: int,
    past_len: int,
    sliding_window: int | None,
    segment_ids: torch.Tensor | None = None,
    parent_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean [B, 1, q_len, past_len + q_len] mask (True = may attend); see the module docstring.

    segment_ids [B, q_len] (no cache): several sequences packed in one row attend only within
    their own segment — the padding-free layout of the trainer.
    parent_ids [B, q_len] (with segment_ids): a token also attends to the earlier tokens of its
    parent segment — the trainer's shared-prefix layout, where the G responses of a prompt are
    segments whose parent is the prompt's one segment (a value matching no segment, e.g. -2: none).
    position_ids [B, q_len] (with segment_ids): the sliding window counts these positions, not row slots
    (a response's prompt lies before its siblings in the row).
    """
    kv_len = past_len + q_len
    q_pos = torch.arange(past_len, kv_len, device=attention_mask.device)[:, None]
    k_pos = torch.arange(kv_len, device=attention_mask.device)[None, :]
    allowed = k_pos <= q_pos
    allowed = allowed[None] & attention_mask[:, None, :kv_len].bool()
    if sliding_window is not None:
        if segment_ids is not None and position_ids is not None:
            allowed = allowed & (position_ids[:, None, :] > position_ids[:, :, None] - sliding_window)
        else:
            allowed = allowed & (k_pos > q_pos - sliding_window)[None]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        if parent_ids is not None:
            same = same | (parent_ids[:, :, None] == segment_ids[:, None, :])
        allowed = allowed & same
    allowed = allowed | (k_pos == q_pos)[None]
    return allowed[:, None]


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCacheLike | None = None,
        return_hidden: bool = False,
        segment_ids: torch.Tensor | None = None,
        parent_ids: torch.Tensor | None = None,
        routing: Routing | None = None,
        layout: PackedLayout | None = None,
    ) -> torch.Tensor:
        """Logits [B, q, V] for `input_ids` [B, q].

        attention_mask: [B, past + q], 1 on real tokens (left or right padding both work).
        position_ids: [B, q]; default = number of real tokens before each slot.
        return_hidden: return the final normed hidden states instead of logits.
        segment_ids: [B, q] packed sequences (give position_ids restarting at each segment).
        parent_ids: [B, q] with segment_ids: each token also sees its parent segment (see build_attention_mask).
        routing: MoE models only: experts to replay and/or the routers' record (relayrl.models.moe.Routing).
        layout: one packed row (B = 1, no cache) whose attention runs per segment (relayrl.models.packed); give
            position_ids. attention_mask, segment_ids and parent_ids are then unused.
        """
        B, q_len = input_ids.shape
        past_len = kv_cache.past_len if kv_cache is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(B, past_len + q_len, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past_len:]
        if layout is not None:
            if layout.sliding_window != self.config.sliding_window:
                raise ValueError(f"packed layout built for sliding_window={layout.sliding_window}, "
                                 f"but the model's is {self.config.sliding_window}")
            mask = layout
        elif (past_len == 0 and segment_ids is None and self.config.sliding_window is None
              and bool(attention_mask.all())):
            mask = None  # every row full and causal: no mask to build or read
        else:
            mask = build_attention_mask(attention_mask, q_len, past_len, self.config.sliding_window, segment_ids,
                                        parent_ids, position_ids if segment_ids is not None else None)
        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, mask, kv_cache, routing)
        h = self.model.norm(h)
        return h if return_hidden else self.lm_head(h)

    def reset_parameters(self, std: float = 0.02, seed: int | None = None) -> None:
        """Initialise like the reference: normal(0, std) for linear / embedding, ones for norms."""
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
