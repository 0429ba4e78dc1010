"""Reward functions (built-in and user-supplied), the pool of worker processes that runs them with a
bound on every call, and the batch scorer.

Names are imported on first use (PEP 562), so `from relayrl.rewards import RewardConfig` loads only
the config (pydantic), not math-verify and sympy; and a reward worker importing
`relayrl.rewards.worker` pays only for the functions it is asked to run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "RewardConfig": "relayrl.rewards.config",
    "RewardFunctionConfig": "relayrl.rewards.config",
    "ScoreResult": "relayrl.rewards.result",
    "Scorer": "relayrl.rewards.scorer",
    "build_scorer": "relayrl.rewards.scorer",
    "RewardPool": "relayrl.rewards.pool",
    "Outcome": "relayrl.rewards.pool",
    "exact_match": "relayrl.rewards.builtin",
    "format_reward": "relayrl.rewards.builtin",
    "task_reward": "relayrl.rewards.builtin",
    "math_reward": "relayrl.rewards.math_answer",
    "RewardFn": "relayrl.rewards.registry",
    "get_reward_fn": "relayrl.rewards.registry",
    "load_user_function": "relayrl.rewards.registry",
    "register_reward": "relayrl.rewards.registry",
    "reward_names": "relayrl.rewards.registry",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from relayrl.rewards.builtin import exact_match, format_reward, task_reward
    from relayrl.rewards.config import RewardConfig, RewardFunctionConfig
    from relayrl.rewards.math_answer import math_reward
    from relayrl.rewards.pool import Outcome, RewardPool
    from relayrl.rewards.registry import RewardFn, get_reward_fn, load_user_function, register_reward, reward_names
    from relayrl.rewards.result import ScoreResult
    from relayrl.rewards.scorer import Scorer, build_scorer


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'relayrl.rewards' has no attribute '{name}'")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
