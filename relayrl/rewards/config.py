"""The `reward:` section of a run config: which reward functions score a sample, and the bounds of the
worker processes that run them.

    reward:
      functions:            a weighted sum; each entry {name, weight, params, batch, args}
        - {name: task}      batch: null tells the function's form by its parameter names (relayrl.rewards.forms);
                            true / false say whether it is TRL's batch form
        - {name: trl.rewards:get_soft_overlong_punishment, args: {max_completion_len: 64, soft_punish_cache: 16}}
                            args: name is a factory, called once at load as factory(**args); what it returns
                            is the reward function (its own parameters tell its form)
        - {name: model, path: DIR, weight: 1.0, params: {batch_size: 16, dtype: float32}}
                            a reward model: DIR is a sequence-classification directory (one label; its logit is
                            the reward) scored by the controller (relayrl.roles.reward_model), not the pool
      timeout_s: 10         one call longer than this is killed and scored on_failure (counted in reward/timeouts);
                            a batch function's call scores one prompt's group of samples
      workers: 2            reward worker processes; 0 runs the functions in the driver (no isolation, no timeout)
      memory_mb: 4096       address space of each worker (RLIMIT_AS); null for no limit
      cpu_s: null           CPU seconds one call may use (RLIMIT_CPU); null means ceil(timeout_s)
      max_reply_mb: 64      the longest answer a worker may send for one call; a longer one fails that call
                            and the worker is replaced (timeout_s bounds the answer's transfer too)
      on_failure: 0.0       the value of a call that fails (raises, times out, crashes, returns a non-real)

This module imports only pydantic and relayrl's config and errors, so a run config can be loaded
without importing any reward function (math-verify and sympy take a second to import); like all of
rewards, it must never import the trainer, the engine, sync or the controller (rewards may use
relayrl.data and the ground floor only).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, model_validator

from relayrl.config import Config

# The name of a reward-model entry: scored by a model in the controller, never looked up as a rule function.
MODEL = "model"
MODEL_PARAMS = {"batch_size": "an integer >= 1 (samples per forward)", "dtype": "float32 or bfloat16"}


class RewardFunctionConfig(Config):
    name: str
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict)
    batch: bool | None = None
    args: dict[str, Any] | None = None  # name is a factory: factory(**args) once at load is the function
    path: str | None = None  # name: model only: the reward model's directory

    @model_validator(mode="after")
    def _model_entry(self) -> RewardFunctionConfig:
        if self.name != MODEL:
            if self.path is not None:
                raise ValueError(f"path is only for reward models (name: {MODEL}); "
                                 f"function '{self.name}' takes its settings in params")
            return self
        if not self.path:
            raise ValueError(f"name: {MODEL} needs path: the directory of a sequence-classification model")
        if self.args is not None:
            raise ValueError(f"args is for reward function factories; a reward model (name: {MODEL}) takes params")
        if self.batch is not None:
            raise ValueError(f"batch is for rule functions; a reward model (name: {MODEL}) batches by "
                             "params.batch_size")
        for k in self.params:
            if k not in MODEL_PARAMS:
                raise ValueError(f"params.{k}: unknown for a reward model; it takes {', '.join(MODEL_PARAMS)}")
        bs = self.params.get("batch_size", 16)
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"params.batch_size must be {MODEL_PARAMS['batch_size']}, got {bs!r}")
        if self.params.get("dtype", "float32") not in ("float32", "bfloat16"):
            raise ValueError(f"params.dtype must be {MODEL_PARAMS['dtype']}, got {self.params['dtype']!r}")
        return self


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
    max_reply_mb: int = Field(64, ge=1, le=4096)  # the longest answer of one call: longer fails it, replaces the worker
    on_failure: float = 0.0

    def rule_config(self) -> RewardConfig:
        """This section without its reward-model entries: what the reward pool runs. It may hold no function
        at all (only models configured); the pool then computes only the task score, for accuracy."""
        # model_copy skips validation on purpose: an empty list is a valid pool (see rewards.scorer.build_scorer)
        return self.model_copy(update={"functions": [f for f in self.functions if f.name != MODEL]})

    def model_entries(self) -> list[tuple[int, RewardFunctionConfig]]:
        """(index in reward.functions, entry) of each reward-model entry, in order."""
        return [(i, f) for i, f in enumerate(self.functions) if f.name == MODEL]

    def user_scored(self) -> bool:
        """Whether the user's own reward scores the run: anything but the built-in task / exact_match
        (relayrl.rewards.naming: exact match is then not called accuracy, and eval/reward is the headline)."""
        from relayrl.rewards.naming import user_scored  # not loaded with a config (tests/test_layering.py)

        return user_scored(f.name for f in self.functions)

    def cpu_limit_s(self) -> int:
        """CPU seconds one call may use: cpu_s, or the wall-clock timeout rounded up."""
        return self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s)
