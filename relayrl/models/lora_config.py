"""LoRAConfig is the `trainer.lora` section: which linears get low-rank adapters, their rank and scale,
and the dtype of the frozen base.

It imports pydantic and relayrl.config only, so a run's config loads without torch (relayrl.models.lora,
which applies it, imports torch); it must never import another relayrl layer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from relayrl.config import Config

# the decoder's linear layers by their Hugging Face names (peft's target_modules spelling)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAConfig(Config):
    """y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T on each target; only A and B train."""

    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS))
    # the frozen base's dtype: bfloat16 halves its memory; the adapters (and their optimizer) stay fp32
    base_dtype: Literal["float32", "bfloat16"] = "float32"

    @field_validator("target_modules")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError(f"give at least one target module (valid: {', '.join(LORA_TARGETS)})")
        bad = [t for t in v if t not in LORA_TARGETS]
        if bad:
            raise ValueError(f"unknown target module(s) {bad} (valid: {', '.join(LORA_TARGETS)})")
        if len(set(v)) != len(v):
            raise ValueError(f"target modules listed twice: {v}")
        return v
