"""This module defines the `arith` task: integer arithmetic, e.g. prompt "12+7=" with answer "19".

Prompts are kept short so a tiny char-level model can learn the task. Operands are uniform in
[0, 10**digits - 1]; the answer follows the usual precedence (`*` before `+`/`-`) and may be
negative. A completion is correct (score 1.0) when its first stripped line equals the answer
exactly; anything else scores 0.0.

It imports the standard library, the task registry and relayrl.errors only; it must never import another
relayrl layer: data is a leaf, which rewards and the controller import.
"""

from __future__ import annotations

import random
from typing import Any

from relayrl.data.tasks import Example, first_line, register_task
from relayrl.errors import ConfigError

ALLOWED_OPS = "+-*"


@register_task("arith")
class ArithTask:
    name = "arith"
    tool_tokens = False

    def __init__(self, digits: int = 2, ops: str = "+-", num_operands: int = 2):
        if not isinstance(digits, int) or not 1 <= digits <= 9:
            raise ConfigError(f"task 'arith': digits must be an integer in 1..9 (got {digits!r})")
        if not isinstance(ops, str) or not ops or any(c not in ALLOWED_OPS for c in ops):
            raise ConfigError(f"task 'arith': ops must be a non-empty subset of '{ALLOWED_OPS}' (got {ops!r})")
        if not isinstance(num_operands, int) or num_operands < 2:
            raise ConfigError(f"task 'arith': num_operands must be an integer >= 2 (got {num_operands!r})")
        self.digits = digits
        self.ops = "".join(dict.fromkeys(ops))
        self.num_operands = num_operands
        self.params: dict[str, Any] = {"digits": digits, "ops": self.ops, "num_operands": num_operands}
        # '-' is always in the alphabet, even without subtraction: it costs one token and lets one
        # tokenizer serve every ops setting of the same task.
        self.alphabet = "0123456789" + "".join(c for c in ALLOWED_OPS if c in self.ops or c == "-") + "="

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        hi = 10**self.digits - 1
        out = []
        for _ in range(n):
            operands = [rng.randint(0, hi) for _ in range(self.num_operands)]
            ops = [rng.choice(self.ops) for _ in range(self.num_operands - 1)]
            expr = str(operands[0]) + "".join(op + str(x) for op, x in zip(ops, operands[1:], strict=True))
            out.append(
                Example(
                    prompt=expr + "=",
                    answer=str(evaluate(operands, ops)),
                    meta={"task": self.name, "params": dict(self.params)},
                )
            )
        return out

    def score(self, completion: str, example: Example) -> float:
        return 1.0 if first_line(completion) == example.answer else 0.0


def evaluate(operands: list[int], ops: list[str]) -> int:
    """Value of operands[0] ops[0] operands[1] ... with `*` binding tighter than `+`/`-`.

    Sum of signed products: each `+`/`-` starts a new term, each `*` multiplies into the current one.
    """
    total, term, sign = 0, operands[0], 1
    for op, x in zip(ops, operands[1:], strict=True):
        if op == "*":
            term *= x
        else:
            total += sign * term
            term, sign = x, (1 if op == "+" else -1)
    return total + sign * term
