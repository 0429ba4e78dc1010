"""This module defines the tasks of the built-in environments: their prompts, answers and hidden data.

    calculator  "What is 482*37+905?"          answer "18739"; too long for a tiny model to do in its head
    guess       "Guess my number from 17 to 48." answer the secret; the environment says higher / lower
    python      "Write a Python function f(x) that returns x*3+1."   meta["tests"]: hidden calls and
                expected values, run in the sandbox by the python environment; answer a reference solution

Each also scores a plain completion (`score`), so the same data runs without an environment too. Their
alphabet is printable ASCII: tool calls, tool results and error messages may use any of it.

It imports the standard library, the task registry and relayrl.errors only; it must never import another
relayrl layer: data is a leaf, which rewards, envs and the controller import.
"""

from __future__ import annotations

import random
import re
import string
from typing import Any

from relayrl.data.arith import evaluate
from relayrl.data.tasks import Example, register_task
from relayrl.errors import ConfigError

PRINTABLE = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
_INT = re.compile(r"-?\d+")


def last_int(text: str) -> str | None:
    found = _INT.findall(text)
    return found[-1] if found else None


def _check_int(task: str, name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"task '{task}': {name} must be an integer in {low}..{high} (got {value!r})")
    return value


@register_task("calculator")
class CalculatorTask:
    """Expressions like 482*37+905: operand sizes in digits, one operator per gap from `ops`."""

    name = "calculator"
    alphabet = PRINTABLE
    tool_tokens = True

    def __init__(self, digits: list[int] | None = None, ops: str = "*+-"):
        digits = [3, 2, 3] if digits is None else digits
        if not isinstance(digits, list) or len(digits) < 2:
            raise ConfigError(f"task 'calculator': digits must be a list of at least 2 sizes (got {digits!r})")
        self.digits = [_check_int("calculator", "each entry of digits", d, 1, 6) for d in digits]
        if not isinstance(ops, str) or not ops or any(c not in "+-*" for c in ops):
            raise ConfigError(f"task 'calculator': ops must be a non-empty subset of '+-*' (got {ops!r})")
        self.ops = ops
        self.params: dict[str, Any] = {"digits": self.digits, "ops": ops}

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(f"calculator/{seed}")
        out = []
        for _ in range(n):
            operands = [rng.randint(10 ** (d - 1), 10**d - 1) for d in self.digits]
            ops = [rng.choice(self.ops) for _ in operands[1:]]
            expr = str(operands[0]) + "".join(op + str(x) for op, x in zip(ops, operands[1:], strict=True))
            out.append(Example(prompt=f"What is {expr}?", answer=str(evaluate(operands, ops)),
                               meta={"task": self.name, "params": dict(self.params), "expression": expr}))
        return out

    def score(self, completion: str, example: Example) -> float:
        return 1.0 if last_int(completion) == example.answer else 0.0


@register_task("guess")
class GuessTask:
    """A secret integer in a range of `high` numbers starting anywhere in 1..1000 (so prompts differ)."""

    name = "guess"
    alphabet = PRINTABLE
    tool_tokens = False

    def __init__(self, high: int = 32):
        self.high = _check_int("guess", "high", high, 2, 10**6)
        self.params: dict[str, Any] = {"high": self.high}

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(f"guess/{seed}")
        out = []
        for _ in range(n):
            low = rng.randint(1, 1000)
            top = low + self.high - 1
            out.append(Example(prompt=f"Guess my number from {low} to {top}. Answer with a number.",
                               answer=str(rng.randint(low, top)),
                               meta={"task": self.name, "params": dict(self.params), "low": low, "high": top}))
        return out

    def score(self, completion: str, example: Example) -> float:
        return 1.0 if last_int(completion) == example.answer else 0.0


# (statement, reference solution, the function's value at x) for one integer constant k
_PROBLEMS = [
    ("returns x*{k}+1", "def f(x):\n    return x*{k}+1", lambda x, k: x * k + 1),
    ("returns x plus {k}", "def f(x):\n    return x+{k}", lambda x, k: x + k),
    ("returns the larger of x and {k}", "def f(x):\n    return max(x, {k})", lambda x, k: max(x, k)),
    ("returns x squared minus {k}", "def f(x):\n    return x*x-{k}", lambda x, k: x * x - k),
    ("returns the remainder of x divided by {k}", "def f(x):\n    return x%{k}", lambda x, k: x % k),
]


@register_task("python")
class PythonTask:
    """Write f(x); hidden tests call it on `num_tests` integers. Scored here by the reference answer only
    (the python environment runs the tests in the sandbox)."""

    name = "python"
    alphabet = PRINTABLE
    tool_tokens = False

    def __init__(self, num_tests: int = 4):
        self.num_tests = _check_int("python", "num_tests", num_tests, 1, 50)
        self.params: dict[str, Any] = {"num_tests": self.num_tests}

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(f"python/{seed}")
        out = []
        for _ in range(n):
            statement, solution, value = rng.choice(_PROBLEMS)
            k = rng.randint(2, 99)
            xs = rng.sample(range(-20, 40), self.num_tests)
            tests = [{"call": f"f({x})", "expected": value(x, k)} for x in xs]
            out.append(Example(prompt=f"Write a Python function f(x) that {statement.format(k=k)}.",
                               answer=f"```python\n{solution.format(k=k)}\n```",
                               meta={"task": self.name, "params": dict(self.params), "tests": tests}))
        return out

    def score(self, completion: str, example: Example) -> float:
        return 1.0 if completion.strip() == example.answer.strip() else 0.0
