"""`relayrl sft`'s config: the sections it shares with `relayrl train` (model, data, reward, trainer, eval, env)
and its own `sft:` section. It imports config modules only, so a bad SFT config is refused before torch loads.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relayrl.config import Config
from relayrl.controller.config import EvalConfig, ModelSection
from relayrl.data.config import DataConfig
from relayrl.envs.config import EnvConfig
from relayrl.rewards.config import RewardConfig
from relayrl.trainer.config import TrainerConfig


class SFTSection(Config):
    steps: int = Field(200, ge=1)
    batch_size: int = Field(64, ge=1)
    seed: int = 0
    out_dir: str = "runs/sft"
    tensorboard: bool = True
    device: Literal["auto", "cpu", "cuda"] = "auto"  # as parallel.device: auto is cuda when torch sees a GPU


class SFTJobConfig(Config):
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)  # scores the held-out eval
    trainer: TrainerConfig = Field(default_factory=lambda: TrainerConfig(lr=1e-3, micro_batch_size=64))
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sft: SFTSection = Field(default_factory=SFTSection)
    env: EnvConfig | None = None  # SFT on the environment's demonstrations (multi-turn traces)

    @model_validator(mode="after")
    def _env_fits(self) -> SFTJobConfig:
        if self.env is not None and self.data.chat_template == "never":
            raise ValueError("env: traces are conversations, rendered through the chat template; "
                             "set data.chat_template=auto (or always)")
        if self.trainer.lora is not None:  # SFT trains the full model; LoRA is the RL trainer's (relayrl train)
            raise ValueError("trainer.lora: SFT trains the full model; remove trainer.lora from the SFT config")
        return self
