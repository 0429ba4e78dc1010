"""This module applies the rotary position embedding (the "rotate half" layout used by Llama, Mistral and
Qwen).

    inv_freq[i] = theta ** (-2i / head_dim),  i < head_dim / 2
    angle[p, i] = position p * inv_freq[i]
    rope(x)     = x * cos(angle) + rotate_half(x) * sin(angle),   rotate_half([a, b]) = [-b, a]

Llama-3 scaling stretches the low frequencies (long wavelengths) by `factor`, keeps the high ones,
and interpolates smoothly between `low_freq_factor` and `high_freq_factor`.

It imports torch only; it must never import another relayrl layer: models hold no parallelism, and every
layer above imports them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from relayrl.models.pointwise import rope


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type '{kind}' (supported: default, linear, llama3)")


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos, sin of shape [B, T, head_dim] computed in fp32, then cast (as the reference does)."""
    angles = position_ids[:, :, None].float() * inv_freq[None, None, :].float()
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [B, T, head_dim] (x * cos + rotate_half(x) * sin, fused where
    relayrl.models.pointwise applies)."""
    return rope(x, cos[:, None], sin[:, None])
