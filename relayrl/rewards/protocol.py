"""The seam between the driver and reward scoring, as a typing.Protocol.

A Scorer turns a step's completions into rewards: `score(completions, examples, check, completion_ids=,
state=) -> ScoreResult`, and owns whatever runs the reward functions (a pool of worker processes), which
`close()` stops. The callers (the rollout sources, the evaluation) pass each completion's sampled token ids and
the trainer state of the step that drew them (relayrl.rewards.state), for TRL's reward functions.
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
from relayrl.rewards.state import TrainerState


class Scorer(Protocol):
    """Scores completions; a sample that cannot be scored counts as a failure, not an error."""

    def score(self, completions: Sequence[str], examples: Sequence[Example], check: bool = True, *,
              completion_ids: Sequence[Sequence[int]] | None = None, state: TrainerState | None = None) -> ScoreResult:
        """Rewards, per-function values, accuracy and failure counts for the batch, in order. With check,
        a function that failed on every sample raises RewardError; without, the caller checks (a part of
        a step: an asynchronous run scores each group as it finishes, and merges a step's results).
        completion_ids: each completion's sampled ids (no prompt), state: the trainer state of the step that
        drew them (None: TrainerState(), before any training); both reach TRL's batch functions."""

    def close(self) -> None:
        """Stop the processes that run the reward functions."""
