"""This module says which trainer-side (Hugging Face) projections an inference model fuses, and in what
order. The engine builds its fused parameters from this map and the sync planner reads it: one source.

It imports nothing; it must never import another relayrl layer: models hold no parallelism, and every
layer above imports them.
"""

from __future__ import annotations

# fused module -> its logical components, in the order they are concatenated along dim 0
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

# logical module -> (fused module, position of the component)
FUSED_INTO: dict[str, tuple[str, int]] = {
    part: (fused, i) for fused, parts in FUSED_PARTS.items() for i, part in enumerate(parts)
}
