"""`ScoreResult`: the rewards of one batch, per function, with its failure and timeout counts, and
the merge of the results of consecutive shards of one step (reward worker groups score a step in shards).

What `correct` measures names its metric (`correct_name`, relayrl.rewards.naming): `reward/accuracy` where it
is a task's own correctness, or the exact match of a dataset file's answer under the built-in reward;
`reward/exact_match` where it is exact match while the user's own reward scores the run.

It imports relayrl.errors only; like all of rewards, it must never import the trainer, the engine, sync
or the controller (rewards may use relayrl.data and the ground floor only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relayrl.errors import RewardError
from relayrl.rewards.naming import ACCURACY, EXACT_MATCH


@dataclass(kw_only=True)
class ScoreResult:
    rewards: list[float]
    per_function: dict[str, list[float]]
    failures: int  # calls that failed, timeouts included
    correct: list[bool]
    failures_per_function: dict[str, int] = field(default_factory=dict)
    timeouts: int = 0  # calls killed after reward.timeout_s
    timeouts_per_function: dict[str, int] = field(default_factory=dict)
    first_errors: dict[str, str] = field(default_factory=dict)  # per function, the first failure's message
    correct_name: str = ACCURACY  # what `correct` measures: accuracy | exact_match (relayrl.rewards.naming)

    @staticmethod
    def merge(parts: list[ScoreResult], check: bool = True) -> ScoreResult:
        """Concatenate the results of consecutive shards of one step; with check, raises RewardError
        when a function failed on every sample of the whole step."""
        n = sum(len(p.rewards) for p in parts)
        names = list(parts[0].per_function)
        fails = {k: sum(p.failures_per_function.get(k, 0) for p in parts) for k in names}
        timeouts = {k: sum(p.timeouts_per_function.get(k, 0) for p in parts) for k in names}
        first = {k: next(p.first_errors[k] for p in parts if k in p.first_errors)
                 for k in names if any(k in p.first_errors for p in parts)}
        for k, f in fails.items():
            if check and n and f == n:
                raise RewardError(f"every sample failed to score in reward function {k}"
                                  + (f": {first[k]}" if k in first else ""))
        return ScoreResult(
            rewards=[r for p in parts for r in p.rewards],
            per_function={k: [v for p in parts for v in p.per_function[k]] for k in names},
            failures=sum(fails.values()),
            correct=[c for p in parts for c in p.correct],
            failures_per_function=fails,
            timeouts=sum(timeouts.values()),
            timeouts_per_function=timeouts,
            first_errors=first,
            # the shards of one step share a scorer; exact match in one shard (an example without a task) is what
            # the whole step's `correct` partly counts
            correct_name=EXACT_MATCH if any(p.correct_name == EXACT_MATCH for p in parts) else ACCURACY,
        )

    def metrics(self) -> dict[str, float]:
        """Scalar metrics for logging: reward/mean, reward/<fn>/mean, reward/failures (timeouts included),
        reward/timeouts, and reward/accuracy or reward/exact_match (correct_name)."""
        n = max(len(self.rewards), 1)
        out = {
            "reward/mean": sum(self.rewards) / n,
            "reward/failures": float(self.failures),
            "reward/timeouts": float(self.timeouts),
            f"reward/{self.correct_name}": sum(self.correct) / n,
        }
        for name, values in self.per_function.items():
            out[f"reward/{name}/mean"] = sum(values) / n
        return out
