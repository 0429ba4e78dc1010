"""`RewardConfig` and the `Scorer`: a weighted sum of reward functions over a batch.

    reward[i]  = sum_f weight_f * value_f[i]
    value_f[i] = fn_f(completion[i], example[i], **params_f), or 0.0 when the call raises or
                 returns something that is not a finite real number (counted in `failures`)
    correct[i] = task score of sample i >= 1.0  (the `task` reward, always computed, for accuracy)

One sample failing is tolerated (a user function may choke on odd model output); every sample of
one function failing in one call means the function itself is broken, so the run stops with a
RewardError carrying the first failure's message.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, field_validator

from relayrl.config import Config
from relayrl.data.tasks import Example
from relayrl.errors import ConfigError, RewardError
from relayrl.rewards.builtin import task_reward
from relayrl.rewards.registry import RewardFn, get_reward_fn


class RewardFunctionConfig(Config):
    name: str
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict)

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


@dataclass
class ScoreResult:
    rewards: list[float]
    per_function: dict[str, list[float]]
    failures: int
    correct: list[bool]
    failures_per_function: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def merge(parts: list["ScoreResult"]) -> "ScoreResult":
        """Concatenate the results of consecutive shards of one step; raises RewardError when a
        function failed on every sample of the whole step."""
        n = sum(len(p.rewards) for p in parts)
        names = list(parts[0].per_function)
        fails = {k: sum(p.failures_per_function.get(k, 0) for p in parts) for k in names}
        for k, f in fails.items():
            if n and f == n:
                raise RewardError(f"every sample failed to score in reward function {k}")
        return ScoreResult(
            rewards=[r for p in parts for r in p.rewards],
            per_function={k: [v for p in parts for v in p.per_function[k]] for k in names},
            failures=sum(fails.values()),
            correct=[c for p in parts for c in p.correct],
            failures_per_function=fails,
        )

    def metrics(self) -> dict[str, float]:
        """Scalar metrics for logging: reward/mean, reward/<fn>/mean, reward/failures, reward/accuracy."""
        n = max(len(self.rewards), 1)
        out = {
            "reward/mean": sum(self.rewards) / n,
            "reward/failures": float(self.failures),
            "reward/accuracy": sum(self.correct) / n,
        }
        for name, values in self.per_function.items():
            out[f"reward/{name}/mean"] = sum(values) / n
        return out


@dataclass
class _Bound:
    name: str
    weight: float
    fn: RewardFn


class Scorer:
    def __init__(self, functions: list[_Bound]):
        self.functions = functions

    def score(self, completions: list[str], examples: list[Example], check: bool = True) -> ScoreResult:
        """check=False: leave the every-sample-failed check to the caller (a shard of a step's
        samples may fail whole while the step does not; see ScoreResult.merge)."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
        n = len(completions)
        rewards = [0.0] * n
        per_function: dict[str, list[float]] = {}
        failures_per_function: dict[str, int] = {}
        for f in self.functions:
            values, errors = _apply(f.fn, completions, examples)
            if check and n and len(errors) == n:
                raise RewardError(f"every sample failed to score in reward function {f.name}: {errors[0]}")
            per_function[f.name] = values
            failures_per_function[f.name] = len(errors)
            rewards = [r + f.weight * v for r, v in zip(rewards, values)]
        correct = [_task_correct(c, ex) for c, ex in zip(completions, examples)]
        return ScoreResult(
            rewards=rewards,
            per_function=per_function,
            failures=sum(failures_per_function.values()),
            correct=correct,
            failures_per_function=failures_per_function,
        )


def _apply(fn: RewardFn, completions: list[str], examples: list[Example]) -> tuple[list[float], list[str]]:
    values, errors = [], []
    for c, ex in zip(completions, examples):
        try:
            v = fn(c, ex)
        except Exception as e:  # user code may raise anything on odd output: score 0, count it
            values.append(0.0)
            errors.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else '(no message)'}")
            continue
        if isinstance(v, numbers.Real) and math.isfinite(float(v)):
            values.append(float(v))
        else:
            values.append(0.0)
            errors.append(f"returned {v!r}, expected a finite number")
    return values, errors


def _task_correct(completion: str, example: Example) -> bool:
    try:
        return task_reward(completion, example) >= 1.0
    except Exception:  # accuracy is a metric: a sample the task cannot score is simply not correct
        return False


def build_scorer(cfg: RewardConfig) -> Scorer:
    bound, seen = [], set()
    for i, fc in enumerate(cfg.functions):
        fn = get_reward_fn(fc.name)
        _check_params(fn, fc, i)
        # Two entries may use the same function with different params; keep their metrics apart.
        name = fc.name if fc.name not in seen else f"{fc.name}#{i}"
        seen.add(name)
        bound.append(_Bound(name=name, weight=fc.weight, fn=functools.partial(fn, **fc.params) if fc.params else fn))
    return Scorer(bound)


def _check_params(fn: RewardFn, fc: RewardFunctionConfig, i: int) -> None:
    """Fail at startup, naming the key, if the params do not fit the function's signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some callables (builtins, C functions) have no signature
        return
    try:
        sig.bind("", None, **fc.params)
    except TypeError as e:
        raise ConfigError(f"config error: reward.functions.{i}.params: {e} (function '{fc.name}')") from None
