"""This module defines the `sort` task: sort a short string of digits, e.g. prompt "sort 3142=" with
answer "1234".

Partial credit, so a tiny model gets a learning signal before it is fully right:

    pred   = first stripped line of the completion
    reward = #{i : pred[i] == answer[i]} / max(len(answer), len(pred))

Positions are compared left to right; dividing by the longer length makes extra characters cost as
much as missing ones. Only the exact answer scores 1.0. Examples: answer "1234" -> "1234": 1.0,
"1243": 0.5, "12345": 0.8, "123": 0.75, "": 0.0.

It imports the standard library, the task registry and relayrl.errors only; it must never import another
relayrl layer: data is a leaf, which rewards and the controller import.
"""

from __future__ import annotations

import random
from typing import Any

from relayrl.data.tasks import Example, first_line, register_task
from relayrl.errors import ConfigError

PREFIX = "sort "


@register_task("sort")
class SortTask:
    name = "sort"
    tool_tokens = False

    def __init__(self, min_len: int = 3, max_len: int = 5):
        if not isinstance(min_len, int) or not isinstance(max_len, int) or not 1 <= min_len <= max_len <= 64:
            raise ConfigError(
                "task 'sort': need integers 1 <= min_len <= max_len <= 64 "
                f"(got min_len={min_len!r}, max_len={max_len!r})"
            )
        self.min_len = min_len
        self.max_len = max_len
        self.params: dict[str, Any] = {"min_len": min_len, "max_len": max_len}
        self.alphabet = "0123456789" + "".join(dict.fromkeys(PREFIX)) + "="

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            length = rng.randint(self.min_len, self.max_len)
            digits = "".join(rng.choice("0123456789") for _ in range(length))
            out.append(
                Example(
                    prompt=f"{PREFIX}{digits}=",
                    answer="".join(sorted(digits)),
                    meta={"task": self.name, "params": dict(self.params)},
                )
            )
        return out

    def score(self, completion: str, example: Example) -> float:
        return position_credit(first_line(completion), example.answer)


def position_credit(pred: str, answer: str) -> float:
    denom = max(len(answer), len(pred))
    if denom == 0:
        return 1.0
    return sum(p == a for p, a in zip(pred, answer, strict=False)) / denom
