"""The seam between the driver and reward scoring, as a typing.Protocol.

A Scorer turns a step's completions into rewards: `score(completions, examples) -> ScoreResult`,
and owns whatever runs the reward functions (a pool of worker processes), which `close()` stops.
relayrl.rewards.scorer.RewardScorer is one (the functions in this process's reward pool); the
reward worker group's handle (relayrl.roles.rule_scorer.RuleScorer, inline or N processes) is another.

It imports the reward result type and relayrl.data only; like all of rewards, it must never import the
trainer, the engine, sync or the controller (rewards may use relayrl.data and the ground floor only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from relayrl.data.tasks import Example
from relayrl.rewards.result import ScoreResult


class Scorer(Protocol):
    """Scores completions; a sample that cannot be scored counts as a failure, not an error."""

    def score(self, completions: Sequence[str], examples: Sequence[Example], check: bool = True) -> ScoreResult:
        """Rewards, per-function values, accuracy and failure counts for the batch, in order. With check,
        a function that failed on every sample raises RewardError; without, the caller checks (a part of
        a step: an asynchronous run scores each group as it finishes, and merges a step's results)."""

    def close(self) -> None:
        """Stop the processes that run the reward functions."""
