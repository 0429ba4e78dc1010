"""This module computes the entropy of the model's next-token distribution at every position.

    H = -sum_v p_v log p_v,   p = softmax(z)
      = logsumexp(z) - sum_v p_v z_v          (since log p_v = z_v - logsumexp(z))

The second form never takes log of a probability that underflowed to 0, so it stays finite for
very peaked distributions. Half-precision logits are upcast to float32 (bf16 keeps ~3 digits, too
few for the sum over V); the result is cast back to the logits' dtype. Gradients flow, so it can be
used as a bonus term.
Memory: this materialises softmax of [B, T, V]; a trainer with a large vocabulary calls it on
chunks of T.

It imports torch only; it must never import another relayrl layer: the algorithms are a leaf, which the
trainer and the controller import.
"""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """logits [B, T, V] -> entropy [B, T] (nats)."""
    z = logits.float() if logits.element_size() < 4 else logits
    p = torch.softmax(z, dim=-1)
    h = torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)
    return h.to(logits.dtype)
