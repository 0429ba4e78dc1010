"""This package holds the algorithm pieces as small registered functions: advantages, policy losses,
aggregation, KL, entropy, rollout-mismatch corrections, group filtering, and the combined actor
objective.

It imports torch, pydantic, the standard library and relayrl.config only; it must never import
another relayrl layer: the algorithms are a leaf, which the trainer and the controller import.
Importing this package registers every built-in estimator / loss / aggregation / KL kind.
"""

from relayrl.algorithms.advantages import dr_grpo, grpo, remax, rloo
from relayrl.algorithms.aggregation import aggregate, masked_max, masked_mean
from relayrl.algorithms.config import AlgoConfig
from relayrl.algorithms.correction import (
    masked_is_sequences,
    mismatch_stats,
    sequence_log_ratio,
    truncated_is_weights,
)
from relayrl.algorithms.entropy import entropy_from_logits
from relayrl.algorithms.filtering import group_has_signal, no_signal_fraction, select_signal_groups
from relayrl.algorithms.kl import kl_penalty
from relayrl.algorithms.objective import policy_objective
from relayrl.algorithms.policy_loss import gspo, ppo
from relayrl.algorithms.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    LOSSES,
    Registry,
    advantage_is_token_level,
    advantage_needs_greedy_baseline,
    get_advantage,
    get_aggregation,
    get_kl,
    get_loss,
    register_advantage,
    register_aggregation,
    register_kl,
    register_loss,
)
from relayrl.algorithms.token_advantages import discounted_returns, global_whiten, reinforce_pp, reinforce_pp_baseline

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "KL_ESTIMATORS", "LOSSES", "Registry",
    "register_advantage", "get_advantage", "register_loss", "get_loss",
    "register_aggregation", "get_aggregation", "register_kl", "get_kl",
    "grpo", "dr_grpo", "rloo", "remax",
    "advantage_is_token_level", "advantage_needs_greedy_baseline",
    "reinforce_pp", "reinforce_pp_baseline", "discounted_returns", "global_whiten",
    "aggregate", "masked_mean", "masked_max",
    "ppo", "gspo",
    "kl_penalty", "entropy_from_logits",
    "truncated_is_weights", "masked_is_sequences", "sequence_log_ratio", "mismatch_stats",
    "group_has_signal", "no_signal_fraction", "select_signal_groups",
    "AlgoConfig", "policy_objective",
]
