"""The `reward:` section of a run config: which reward functions score a sample, and the bounds of the
worker processes that run them.

    reward:
      functions:            a weighted sum; each entry {name, weight, params, batch}
        - {name: task}      batch: null tells the function's form by its signature (a parameter named
                            `completions`: TRL's batch form); true / false say it (see relayrl.rewards.calls)
      timeout_s: 10         one call longer than this is killed and scored on_failure (counted in reward/timeouts);
                            a batch function's call scores one prompt's group of samples
      workers: 2            reward worker processes; 0 runs the functions in the driver (no isolation, no timeout)
      memory_mb: 4096       address space of each worker (RLIMIT_AS); null for no limit
      cpu_s: null           CPU seconds one call may use (RLIMIT_CPU); null means ceil(timeout_s)
      on_failure: 0.0       the value of a call that fails (raises, times out, crashes, returns a non-real)

This module imports only pydantic and relayrl's config and errors, so a run config can be loaded
without importing any reward function (math-verify and sympy take a second to import); like all of
rewards, it must never import the trainer, the engine, sync or the controller (rewards may use
relayrl.data and the ground floor only).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, field_validator

from relayrl.config import Config


class RewardFunctionConfig(Config):
    name: str
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict)
    batch: bool | None = None

    @field_validator("weight")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("weight must be a finite number")
        return v


class RewardConfig(Config):
    functions: list[RewardFunctionConfig] = Field(
        default_factory=lambda: [RewardFunctionConfig(name="task")], min_length=1
    )
    timeout_s: float = Field(10.0, gt=0)
    # Two: scoring runs between rollout and update, when the trainer's cores are idle; on a 2-core
    # machine more workers only share the same cores (and each holds its own imports in memory).
    workers: int = Field(2, ge=0)
    memory_mb: int | None = Field(4096, ge=64)
    cpu_s: int | None = Field(None, ge=1)
    on_failure: float = 0.0

    @field_validator("timeout_s", "on_failure")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    def cpu_limit_s(self) -> int:
        """CPU seconds one call may use: cpu_s, or the wall-clock timeout rounded up."""
        return self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s)
