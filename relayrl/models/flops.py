"""Model FLOPs of the decoder, from its shape alone (PaLM-style: the matmuls, no recomputation).

    N          weights of every matmul: per layer q, k, v, o (heads x head_dim rows / columns), gate, up,
               down; plus the lm_head (a tied embedding counted once, as the lm_head: its lookup is no
               matmul). Biases, norms and the embedding lookup are left out.
    attention  per token and layer, QK^T and attention x V: 2 x 2 x heads x head_dim per key attended

    forward    2N per token  + 4 L H d per key attended
    training   6N per token  + 12 L H d per key attended (forward + backward: twice the forward's again)

The training count follows benchmarks/bench_trainer.py: every token of a row attends to the row's full
length T (the causal mask halves the useful work, but the kernels compute the square), so
flops = tokens x (6N + 12 L H d T). The engine's count is the work it really did: each computed token
attends to its own position + 1 keys (relayrl.engine.outputs.SampleCost.attended).

It imports relayrl.models.config only; like all of models, it must never import another relayrl layer.
"""

from __future__ import annotations

from relayrl.models.config import ModelShape


def matmul_params(shape: ModelShape) -> int:
    """N: the weights that take part in a matmul (equal to the 2-D parameters of CausalLM, the tied
    embedding counted once)."""
    h, d = shape.hidden_size, shape.head_dim
    attn = h * d * (shape.num_attention_heads * 2 + shape.num_key_value_heads * 2)  # q, o; k, v
    mlp = 3 * h * shape.intermediate_size  # gate, up, down
    return shape.num_hidden_layers * (attn + mlp) + shape.vocab_size * h


def attention_flops_per_key(shape: ModelShape) -> int:
    """Forward FLOPs per (token, key attended) pair over all layers: 4 L H d."""
    return 4 * shape.num_hidden_layers * shape.num_attention_heads * shape.head_dim


def forward_flops(shape: ModelShape, tokens: int, keys_per_token: int) -> int:
    """A forward over `tokens` tokens, each attending to `keys_per_token` keys (a row's length T)."""
    return tokens * (2 * matmul_params(shape) + attention_flops_per_key(shape) * keys_per_token)


def train_flops(shape: ModelShape, tokens: int, keys_per_token: int) -> int:
    """Forward and backward over `tokens` tokens: three forwards' worth (6N + 12 L H d T per token)."""
    return 3 * forward_flops(shape, tokens, keys_per_token)


def generate_flops(shape: ModelShape, computed_tokens: int, attended: int) -> int:
    """What the engine computed: 2N per token it ran, plus 4 L H d per key those tokens attended to."""
    return 2 * matmul_params(shape) * computed_tokens + attention_flops_per_key(shape) * attended
