"""This module names model shapes for planning a sync or a layout without a model directory
(`relayrl sync-plan --preset NAME`, `relayrl plan --preset NAME`).

A preset holds only what decides tensor names and shapes (ModelShape); the numbers are those of the
public config.json files of these models.

It imports relayrl.models (ModelShape) and relayrl.errors only; like all of sync, it must never import
the trainer, the engine or the controller: the controller hands it plain tensors.
"""

from __future__ import annotations

from relayrl.errors import ConfigError
from relayrl.models.config import ModelShape

PRESETS: dict[str, ModelShape] = {
    # the planner's test case: 8 Q heads over 2 KV heads, so engine TP 4 replicates KV heads
    "tiny-gqa": ModelShape(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=4, qkv_bias=True,
                           tie_word_embeddings=True),
    "qwen2.5-0.5b": ModelShape(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, head_dim=64, qkv_bias=True,
                               tie_word_embeddings=True),
    "qwen2.5-7b": ModelShape(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                             num_attention_heads=28, num_key_value_heads=4, head_dim=128, qkv_bias=True),
    "qwen3-8b": ModelShape(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, qk_norm=True),
    "llama-3.1-8b": ModelShape(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    # the large shapes `relayrl plan` is asked about (the reading's 70B figures)
    "qwen2.5-32b": ModelShape(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                              num_attention_heads=40, num_key_value_heads=8, head_dim=128, qkv_bias=True),
    "llama-3-70b": ModelShape(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                              num_attention_heads=64, num_key_value_heads=8, head_dim=128),
    "qwen2.5-72b": ModelShape(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                              num_attention_heads=64, num_key_value_heads=8, head_dim=128, qkv_bias=True),
}


def preset(name: str) -> ModelShape:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)}); or pass --model DIR")
    return PRESETS[name]
