"""This module builds the tiny model of the built-in tasks: a small decoder with a character tokenizer,
written as a Hugging Face directory, so tiny and real models share every code path after this point.

It imports the models' own modules only; it must never import another relayrl layer: models hold no
parallelism, and every layer above imports them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from relayrl.models.config import ModelConfig, TinyModelConfig
from relayrl.models.hf_io import save_pretrained
from relayrl.models.tokenizer import build_char_tokenizer
from relayrl.models.transformer import CausalLM


def build_tiny_model(out_dir: str | Path, alphabet: str, cfg: TinyModelConfig, tool_tokens: bool = False) -> Path:
    """Write a randomly initialised tiny model + char tokenizer over `alphabet` to `out_dir` (with the
    tool-call tags as tokens of their own when `tool_tokens`)."""
    out = Path(out_dir)
    tok_dir = out.parent / f".tok_{out.name}"
    tok = build_char_tokenizer(tok_dir, alphabet, model_type=cfg.model_type, tool_tokens=tool_tokens)
    heads = cfg.num_attention_heads
    mc = ModelConfig(
        model_type=cfg.model_type,
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // heads,
        qkv_bias=cfg.model_type == "qwen2",
        qk_norm=cfg.model_type == "qwen3",
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = CausalLM(mc)
    model.reset_parameters(std=cfg.init_std, seed=cfg.seed)
    save_pretrained(model, out, tokenizer_dir=tok_dir)
    shutil.rmtree(tok_dir, ignore_errors=True)
    return out


def build_tiny_moe_model(out_dir: str | Path, alphabet: str, *, hidden_size: int = 32, num_experts: int = 4,
                         moe_intermediate_size: int = 16, init_std: float = 0.2, router_std: float = 1.0,
                         seed: int = 0) -> Path:
    """Write a random 2-layer Qwen3-MoE (top-2 of `num_experts`, 4 heads / 2 KV heads, tied) + char tokenizer over
    `alphabet` to `out_dir`: for tests and benchmarks of MoE runs (TinyModelConfig builds dense models). Routers
    are drawn with std `router_std`, apart from the rest: large, most tokens' top-k is clear of ties; small,
    near-ties let two computations of the same routing disagree."""
    import torch

    from relayrl.models.config import MoEConfig

    out = Path(out_dir)
    tok_dir = out.parent / f".tok_{out.name}"
    tok = build_char_tokenizer(tok_dir, alphabet, model_type="qwen3")
    cfg = MoEConfig(model_type="qwen3_moe", vocab_size=len(tok), hidden_size=hidden_size,
                    intermediate_size=2 * hidden_size, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=hidden_size // 4, qk_norm=True, tie_word_embeddings=True,
                    max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id, num_experts=num_experts, num_experts_per_tok=2,
                    moe_intermediate_size=moe_intermediate_size, norm_topk_prob=True)
    model = CausalLM(cfg)
    model.reset_parameters(std=init_std, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * router_std)
    save_pretrained(model, out, tokenizer_dir=tok_dir)
    shutil.rmtree(tok_dir, ignore_errors=True)
    return out
