"""Reward functions (built-in and user-supplied) and the batch scorer."""

from relayrl.rewards.builtin import exact_match, format_reward, task_reward
from relayrl.rewards.math_answer import math_reward
from relayrl.rewards.registry import RewardFn, get_reward_fn, load_user_function, register_reward, reward_names
from relayrl.rewards.scorer import RewardConfig, RewardFunctionConfig, Scorer, ScoreResult, build_scorer

__all__ = [
    "RewardConfig",
    "RewardFn",
    "RewardFunctionConfig",
    "ScoreResult",
    "Scorer",
    "build_scorer",
    "exact_match",
    "format_reward",
    "get_reward_fn",
    "load_user_function",
    "math_reward",
    "register_reward",
    "reward_names",
    "task_reward",
]
