"""Reward functions (built-in and user-supplied), the pool of worker processes that runs them with a
bound on every call, and the batch scorer.

Names are imported on first use (PEP 562), so `from relayrl.rewards import RewardConfig` loads only
the config (pydantic), not math-verify and sympy; and a reward worker importing
`relayrl.rewards.worker` pays only for the functions it is asked to run.

The package imports relayrl.data and the ground floor only; it must never import the trainer, the
engine, sync or the controller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relayrl.lazy import lazy_exports

_EXPORTS = {
    "RewardConfig": "relayrl.rewards.config",
    "RewardFunctionConfig": "relayrl.rewards.config",
    "ScoreResult": "relayrl.rewards.result",
    "RewardScorer": "relayrl.rewards.scorer",
    "Scorer": "relayrl.rewards.protocol",
    "TrainerState": "relayrl.rewards.state",
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

__all__ = ["Outcome", "RewardConfig", "RewardFn", "RewardFunctionConfig", "RewardPool", "RewardScorer",
           "ScoreResult", "Scorer", "TrainerState", "build_scorer", "exact_match", "format_reward", "get_reward_fn",
           "load_user_function", "math_reward", "register_reward", "reward_names", "task_reward"]

if TYPE_CHECKING:
    from relayrl.rewards.builtin import exact_match, format_reward, task_reward
    from relayrl.rewards.config import RewardConfig, RewardFunctionConfig
    from relayrl.rewards.math_answer import math_reward
    from relayrl.rewards.pool import Outcome, RewardPool
    from relayrl.rewards.protocol import Scorer
    from relayrl.rewards.registry import RewardFn, get_reward_fn, load_user_function, register_reward, reward_names
    from relayrl.rewards.result import ScoreResult
    from relayrl.rewards.scorer import RewardScorer, build_scorer
    from relayrl.rewards.state import TrainerState


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
