"""Rule-based built-in rewards: exact_match, format, task.

    exact_match  1.0 if the completion's first stripped line equals the answer, else 0.0; an example with
                 no answer (a file without an answer column: data.answer_field null, or data.format trl)
                 is never matched, so an empty completion does not count as correct
    format       1.0 if the stripped completion fully matches `pattern` (default: one non-empty
                 line, i.e. the model answered and stopped), else 0.0
    task         the score of the built-in task that generated the example (meta["task"] and
                 meta["params"], set by every task's generate); examples without a task (loaded
                 from a file) fall back to exact_match. Its value >= 1.0 is what "correct" means.

It imports the reward registry and relayrl.data only; like all of rewards, it must never import the
trainer, the engine, sync or the controller (rewards may use relayrl.data and the ground floor only).
"""

from __future__ import annotations

import re

from relayrl.data.tasks import Example, first_line, task_for_example
from relayrl.rewards.registry import register_reward

DEFAULT_FORMAT_PATTERN = r"[^\n]+"


@register_reward("exact_match")
def exact_match(completion: str, example: Example) -> float:
    gold = example.answer.strip()
    return 1.0 if gold and first_line(completion) == gold else 0.0


@register_reward("format")
def format_reward(completion: str, example: Example, pattern: str = DEFAULT_FORMAT_PATTERN) -> float:
    # re caches compiled patterns, so compiling per call is cheap.
    return 1.0 if re.fullmatch(pattern, completion.strip(), flags=re.DOTALL) else 0.0


@register_reward("task")
def task_reward(completion: str, example: Example) -> float:
    task = task_for_example(example)
    if task is None:
        return exact_match(completion, example)
    return float(task.score(completion, example))
