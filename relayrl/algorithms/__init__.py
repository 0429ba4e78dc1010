"""This package holds the algorithm pieces as small registered functions: advantages, policy losses,
aggregation, KL, entropy, rollout-mismatch corrections, group filtering, and the combined actor
objective.

It imports torch, pydantic, the standard library and relayrl.config only; it must never import
another relayrl layer: the algorithms are a leaf, which the trainer and the controller import.
Its names are exported lazily (relayrl.lazy): importing the package, or its config, imports no torch; a
built-in estimator / loss / aggregation / KL kind is registered when first looked up (relayrl.algorithms.registry).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relayrl.lazy import lazy_exports

_EXPORTS = {
    "AdvantageInputs": "relayrl.algorithms.estimate",
    "Advantages": "relayrl.algorithms.estimate",
    "estimate_advantages": "relayrl.algorithms.estimate",
    "dr_grpo": "relayrl.algorithms.advantages",
    "grpo": "relayrl.algorithms.advantages",
    "remax": "relayrl.algorithms.advantages",
    "rloo": "relayrl.algorithms.advantages",
    "aggregate": "relayrl.algorithms.aggregation",
    "masked_max": "relayrl.algorithms.aggregation",
    "masked_mean": "relayrl.algorithms.aggregation",
    "AlgoConfig": "relayrl.algorithms.config",
    "masked_is_sequences": "relayrl.algorithms.correction",
    "mismatch_stats": "relayrl.algorithms.correction",
    "sequence_log_ratio": "relayrl.algorithms.correction",
    "truncated_is_weights": "relayrl.algorithms.correction",
    "entropy_from_logits": "relayrl.algorithms.entropy",
    "group_has_signal": "relayrl.algorithms.filtering",
    "no_signal_fraction": "relayrl.algorithms.filtering",
    "select_signal_groups": "relayrl.algorithms.filtering",
    "kl_penalty": "relayrl.algorithms.kl",
    "policy_objective": "relayrl.algorithms.objective",
    "gspo": "relayrl.algorithms.policy_loss",
    "ppo": "relayrl.algorithms.policy_loss",
    "ADVANTAGES": "relayrl.algorithms.registry",
    "AGGREGATIONS": "relayrl.algorithms.registry",
    "KL_ESTIMATORS": "relayrl.algorithms.registry",
    "LOSSES": "relayrl.algorithms.registry",
    "Registry": "relayrl.algorithms.registry",
    "advantage_is_token_level": "relayrl.algorithms.registry",
    "advantage_needs_greedy_baseline": "relayrl.algorithms.registry",
    "get_advantage": "relayrl.algorithms.registry",
    "get_aggregation": "relayrl.algorithms.registry",
    "get_kl": "relayrl.algorithms.registry",
    "get_loss": "relayrl.algorithms.registry",
    "register_advantage": "relayrl.algorithms.registry",
    "register_aggregation": "relayrl.algorithms.registry",
    "register_kl": "relayrl.algorithms.registry",
    "register_loss": "relayrl.algorithms.registry",
    "discounted_returns": "relayrl.algorithms.token_advantages",
    "global_whiten": "relayrl.algorithms.token_advantages",
    "reinforce_pp": "relayrl.algorithms.token_advantages",
    "reinforce_pp_baseline": "relayrl.algorithms.token_advantages",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["advantage_is_token_level", "advantage_needs_greedy_baseline", "AdvantageInputs", "Advantages",
    "ADVANTAGES", "aggregate", "AGGREGATIONS", "AlgoConfig", "discounted_returns", "dr_grpo", "entropy_from_logits",
    "estimate_advantages", "get_advantage", "get_aggregation", "get_kl", "get_loss", "global_whiten",
    "group_has_signal", "grpo", "gspo", "KL_ESTIMATORS", "kl_penalty", "LOSSES", "masked_is_sequences", "masked_max",
    "masked_mean", "mismatch_stats", "no_signal_fraction", "policy_objective", "ppo", "register_advantage",
    "register_aggregation", "register_kl", "register_loss", "Registry", "reinforce_pp", "reinforce_pp_baseline",
    "remax", "rloo", "select_signal_groups", "sequence_log_ratio", "truncated_is_weights"]

if TYPE_CHECKING:  # what editors and type checkers follow to the definitions
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
    from relayrl.algorithms.estimate import AdvantageInputs, Advantages, estimate_advantages
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
    from relayrl.algorithms.token_advantages import (
        discounted_returns,
        global_whiten,
        reinforce_pp,
        reinforce_pp_baseline,
    )
