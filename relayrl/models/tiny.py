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
