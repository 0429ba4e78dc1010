"""TrainerConfig sets the optimiser, schedule and batching of the actor update (the `trainer:` section).

This module imports pydantic, relayrl.config and relayrl.models' torch-free LoRA config only, so that
loading a run's config stays cheap; like all of the trainer, it must never import the engine, sync, the
controller or the CLI.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relayrl.config import Config
from relayrl.models.lora_config import LoRAConfig


class TrainerConfig(Config):
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0)  # None: no clipping (the norm is still reported)
    # an optimiser step whose loss or gradient norm is NaN or inf is skipped (counted in skipped_nonfinite); this
    # many in a row stop the run in one line (relayrl.trainer.nonfinite)
    max_nonfinite_steps: int = Field(3, ge=1)
    # the schedule steps once per RL step: linear warm-up, then constant or cosine to min_lr_ratio
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    # per rollout batch: ppo_epochs passes, each split into mini_batches optimiser steps;
    # each mini-batch runs as micro-batches of micro_batch_size sequences (gradient accumulation)
    ppo_epochs: int = Field(1, ge=1)
    mini_batches: int = Field(1, ge=1)
    micro_batch_size: int = Field(32, ge=1)
    shuffle: bool = True  # shuffle sequences between mini-batches (seeded)
    bf16: bool = False  # autocast the forward to bf16; master weights and optimiser stay fp32
    # pack sequences into rows without padding; the samples of a prompt compute its tokens once (shared_prefix,
    # None: on with padding_free). Both exact: the same losses and gradients as padded rows
    padding_free: bool = True
    shared_prefix: bool | None = None
    # low-rank adapters on the decoder's linears (relayrl.models.lora); only the adapters train, the base
    # stays frozen (optionally in bf16). None: full fine-tuning
    lora: LoRAConfig | None = None


    @model_validator(mode="after")
    def _shared_prefix_is_packed(self) -> TrainerConfig:
        if self.shared_prefix and not self.padding_free:
            raise ValueError("shared_prefix: the shared prompt is a packed layout; set padding_free=true as well")
        return self

    @property
    def shares_prefix(self) -> bool:
        """Whether the samples of a prompt compute it once (shared_prefix, or by default padding_free)."""
        return self.padding_free if self.shared_prefix is None else self.shared_prefix


class CriticConfig(TrainerConfig):
    """The `critic:` section (PPO with a critic, `algo.advantage: gae`): the value model's own optimiser,
    schedule and batching (every `trainer.*` key, with their defaults), where it starts, and how many RL
    steps it trains alone before the actor moves (its values start from nothing; early advantages are noise)."""

    padding_free: bool = False  # the critic runs on padded rows
    shared_prefix: bool | None = None
    path: str | None = None  # a sequence-classification directory (one label); None: the policy with a fresh head
    head_std: float = Field(0.0, ge=0)  # the fresh head's init std (0: every value starts at 0)
    warmup_updates: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _padded(self) -> CriticConfig:
        if self.padding_free:
            raise ValueError("padding_free: the critic runs on padded rows; set critic.padding_free=false")
        if self.lora is not None:
            raise ValueError("lora: the critic trains in full (its fresh value head must learn); remove critic.lora")
        return self
