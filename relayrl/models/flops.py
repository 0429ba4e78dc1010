"""Model FLOPs of the decoder, from its shape alone (PaLM-style: the matmuls, no recomputation).

    N          weights of every matmul: per layer q, k, v, o (heads x head_dim rows / columns), gate, up,
               down; plus the lm_head, V x h (a tied embedding is counted once, as the lm_head: its lookup
               is no matmul; an untied embedding's V x h is a lookup too and left out). Biases, norms and
               the embedding lookup are left out.
    N_body     N - V h: the decoder layers alone, which run at every token
    attention  per token and layer, QK^T and attention x V: 2 x 2 x heads x head_dim per key attended

    forward    2N per token  + 4 L H d per key attended
    training   6N per token  + 12 L H d per key attended (forward + backward: twice the forward's again)
    LoRA       4 N_base + 6 N_adapters per token + 12 L H d per key attended: the frozen base runs its forward
               (2N) and the input gradient that reaches the adapters below (2N), never a weight gradient;
               the adapters (r x (in + out) each) run all three. Attention has no weights: unchanged.
    generate   2 N_body per token the engine computed + 2 V h per logit position + 4 L H d per key attended

The trainer computes logits at every position (relayrl.models.transformer: lm_head over all of h, then
relayrl.trainer.logprobs slices), so its tokens pay the lm_head: 2N / 6N per token. The engine computes them
only at each sequence's last position of a model run (relayrl.engine.model: `h[batch.last_index]`): a
prefill of P tokens pays 2 N_body P + 2 V h once, a decode step 2 N_body + 2 V h
(relayrl.engine.outputs.SampleCost.logit_positions).

The training count follows benchmarks/bench_trainer.py: every token of a row attends to the row's full
length T (the causal mask halves the useful work, but the kernels compute the square), so
flops = tokens x (6N + 12 L H d T). The engine's count is the work it really did: each computed token
attends to its own position + 1 keys (relayrl.engine.outputs.SampleCost.attended).

LoRA's 4N is the usual convention: autograd also skips the input gradient of the first layer's projections of
the (frozen) embedding's output, so the true count is lower by at most 2 x (q, k, v, gate, up of one layer).

It imports relayrl.models.config only; like all of models, it must never import another relayrl layer.
"""

from __future__ import annotations

from collections.abc import Iterable

from relayrl.models.config import ModelShape

# the decoder's linear layers by their Hugging Face names (relayrl.models.lora_config.LORA_TARGETS)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_dims(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """{name: (in_features, out_features)} of each of one layer's linears."""
    h, inter = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def lm_head_params(shape: ModelShape) -> int:
    """V h: the lm_head's weights (the logits' matmul)."""
    return shape.vocab_size * shape.hidden_size


def matmul_params(shape: ModelShape) -> int:
    """N: the weights that take part in a matmul: the decoder layers' linears and the lm_head (a tied
    embedding counted once, as the lm_head; an untied embedding, a lookup, not at all)."""
    layer = sum(i * o for i, o in linear_dims(shape).values())
    return shape.num_hidden_layers * layer + lm_head_params(shape)


def adapter_params(shape: ModelShape, rank: int, targets: Iterable[str] = LINEARS) -> int:
    """N_adapters: LoRA's lora_A [r, in] and lora_B [out, r] on each target linear of every layer."""
    dims = linear_dims(shape)
    return shape.num_hidden_layers * sum(rank * sum(dims[t]) for t in targets)


def attention_flops_per_key(shape: ModelShape) -> int:
    """Forward FLOPs per (token, key attended) pair over all layers: 4 L H d."""
    return 4 * shape.num_hidden_layers * shape.num_attention_heads * shape.head_dim


def forward_flops(shape: ModelShape, tokens: int, keys_per_token: int) -> int:
    """A forward over `tokens` tokens, each attending to `keys_per_token` keys (a row's length T)."""
    return tokens * (2 * matmul_params(shape) + attention_flops_per_key(shape) * keys_per_token)


def train_flops(shape: ModelShape, tokens: int, keys_per_token: int) -> int:
    """Forward and backward over `tokens` tokens: three forwards' worth (6N + 12 L H d T per token)."""
    return 3 * forward_flops(shape, tokens, keys_per_token)


def lora_train_flops(shape: ModelShape, tokens: int, keys_per_token: int, *, rank: int,
                     targets: Iterable[str] = LINEARS) -> int:
    """Forward and backward with a frozen base and LoRA adapters on `targets`:
    tokens x (4 N + 6 N_adapters + 12 L H d T)."""
    per_token = (4 * matmul_params(shape) + 6 * adapter_params(shape, rank, targets)
                 + 3 * attention_flops_per_key(shape) * keys_per_token)
    return tokens * per_token


def generate_flops(shape: ModelShape, computed_tokens: int, attended: int, logit_positions: int | None = None) -> int:
    """What the engine computed: 2 N_body per token it ran, 2 V h per position it produced logits at (one per
    model run the sequence took part in), plus 4 L H d per key those tokens attended to. logit_positions=None
    charges the lm_head at every computed token (2N per token: an upper bound)."""
    rows = computed_tokens if logit_positions is None else logit_positions
    body = matmul_params(shape) - lm_head_params(shape)
    return (2 * body * computed_tokens + 2 * lm_head_params(shape) * rows
            + attention_flops_per_key(shape) * attended)
