"""The tiny model of the built-in tasks: a small decoder with a character tokenizer, written as a
Hugging Face directory, so tiny and real models share every code path after this point."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

from pydantic import Field

from relayrl.config import Config
from relayrl.models.config import ModelConfig
from relayrl.models.hf_io import save_pretrained
from relayrl.models.tokenizer import build_char_tokenizer
from relayrl.models.transformer import CausalLM


class TinyModelConfig(Config):
    model_type: Literal["llama", "mistral", "qwen2", "qwen3"] = "qwen2"
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(384, ge=8)
    num_hidden_layers: int = Field(4, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    tie_word_embeddings: bool = True
    init_std: float = Field(0.02, gt=0)
    seed: int = 0


def build_tiny_model(out_dir: str | Path, alphabet: str, cfg: TinyModelConfig) -> Path:
    """Write a randomly initialised tiny model + char tokenizer over `alphabet` to `out_dir`."""
    out = Path(out_dir)
    tok_dir = out.parent / f".tok_{out.name}"
    tok = build_char_tokenizer(tok_dir, alphabet, model_type=cfg.model_type)
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
