"""What a run's correctness figure is called, and which held-out figure it reports first. Metric names say what
they measure: exact match is called accuracy only where nothing else judges the answers.

    correct[i]   the built-in `task` reward's score >= 1.0 (relayrl.rewards.scorer): for a generated example its
                 task's own scorer; for an example loaded from a file, the exact match of the completion's first
                 line with the answer column

    the run's reward               what correct[i] is      its metrics
    only task / exact_match        either                  reward/accuracy, eval/accuracy
    anything else (the user's)     a task's own scorer     reward/accuracy, eval/accuracy
    anything else (the user's)     exact match             reward/exact_match, eval/exact_match

    held_out_metric: eval/reward where the user's own reward scores the run (its scorer says what is right), else
    eval/accuracy (an environment's episodes: their success)

It imports nothing of relayrl, so the command line can name the figure before torch loads; like all of rewards,
it must never import the trainer, the engine, sync or the controller.
"""

from __future__ import annotations

from collections.abc import Iterable

ACCURACY, EXACT_MATCH = "accuracy", "exact_match"
BUILTIN_CORRECTNESS = ("task", "exact_match")  # the rewards that are the correctness they are scored by


def user_scored(function_names: Iterable[str]) -> bool:
    """Whether a reward of these reward.functions names is the user's own (anything but task and exact_match:
    a user function, a built-in like math or format, a reward model)."""
    return any(name not in BUILTIN_CORRECTNESS for name in function_names)


def correct_name(user_reward: bool, exact_match: bool) -> str:
    """The name of what `correct` measures: exact_match where it is exact match (an example without a task)
    while the user's own reward scores the run, else accuracy."""
    return EXACT_MATCH if user_reward and exact_match else ACCURACY


def held_out_metric(function_names: Iterable[str], env: bool = False) -> str:
    """The held-out figure a run reports first: eval/reward for the user's own reward, else eval/accuracy."""
    return "eval/accuracy" if env or not user_scored(function_names) else "eval/reward"
